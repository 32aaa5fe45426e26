# -*- coding: utf-8 -*-
# Copyright (c) gpufleet.reclaim contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# PRIVATE: part of the gpufleet.reclaim core. Plain Python, no Ansible imports; not a public API.
"""The data of the rogue (crypto-miner) detector: built-in rules, weights, names, lists, patterns.

Everything here is data; the other files of this package hold the logic.  The lists are
summarised from public detection rule sets (Falco, Sigma, Elastic) and from miners' documented
options; they are written from scratch, not copied.  docs/rogue-detection.md explains every rule.
"""

from __future__ import annotations

import re

from ..constants import ROGUE_LEVELS

LEVELS = ROGUE_LEVELS
KINDS = ('hard', 'soft', 'behavioural')

# Score thresholds (0-100 scale).  critical needs a hard indicator; high needs a hard indicator
# or at least SOFT_HIGH_GATE points of soft indicators (so one soft indicator plus behaviour,
# such as a masquerade on a busy GPU, stays at medium).
CRITICAL_AT = 80
HIGH_AT = 60
MEDIUM_AT = 35
SOFT_HIGH_GATE = 50
# Behavioural indicators together never count for more than this, so they alone stay below high.
BEHAVIOURAL_CAP = 40
MAX_SCORE = 100
MIN_WEIGHT = 0
MAX_WEIGHT = 100

# id -> (kind, weight, description).  The order is the order of evaluation and of the output.
BUILTIN_RULES = (
    ('H-stratum', 'hard', 60, 'a stratum mining URL (stratum+tcp, stratum+ssl, stratum2, ...) in the command line or environment'),
    ('H-miner-flags', 'hard', 45, 'a set of options only miners use (--donate-level, --nicehash, -epool/-ewal, '
                                  'a pool option with an algorithm from the list or with --coin, ...)'),
    ('H-wallet', 'hard', 40, 'a cryptocurrency wallet address (Monero, Ethereum, Bitcoin, Litecoin, Ravencoin, Ergo, Kaspa) '
                             'as the value of a user/wallet option or as the user part of a pool URL'),
    ('H-pool-host', 'hard', 50, 'a known mining pool host (built-in or configured pool list) named in the command line or environment'),
    ('H-pool-conn', 'hard', 60, 'a TCP connection to an address in the configured pool list'),
    ('H-pool-port', 'hard', 40, 'a TCP connection to a public address on a well-known mining pool port'),
    ('S-miner-name', 'soft', 35, 'the process name, argv[0] or executable is a known miner binary'),
    ('S-algo', 'soft', 30, 'an algorithm option (-a, --algo, --algorithm) whose value is a mining algorithm'),
    ('S-masquerade', 'soft', 25, 'the process claims to be something its executable is not (argv[0] python but the executable '
                                 'is no Python interpreter, a fake [kernel thread], a system daemon name on another binary)'),
    ('S-exe-location', 'soft', 25, 'the executable was deleted, is a memfd, or lies in /tmp, /var/tmp, /dev/shm or a hidden directory'),
    ('S-miner-env', 'soft', 15, 'environment variables that mining scripts set (GPU_MAX_ALLOC_PERCENT, CUDA_DISABLE_CONTROL, ...)'),
    ('S-no-allocation', 'soft', 20, 'GPU use outside any Slurm job or container on a host that allocates GPUs through them'),
    ('B-flat-util', 'behavioural', 15, 'GPU utilization at or above 95% with a coefficient of variation under 3% over the window'),
    ('B-flat-mem', 'behavioural', 5, 'GPU memory flat over the window and below a quarter of the GPU'),
    ('B-no-ml-libs', 'behavioural', 10, 'no ML library (libcudnn, libnccl, libtorch, libtensorflow, XLA/JAX, ...) mapped'),
    ('B-lineage', 'behavioural', 15, 'started by a web server, by cron/at, or by a "curl | sh" style pipeline'),
)
# Suppressors lower only the behavioural part of a score.
BUILTIN_SUPPRESSORS = (
    ('N-ml-libs', -20, 'ML libraries are mapped (behavioural score lowered)'),
)

# ---------------------------------------------------------------------------- content patterns
# Every pattern here is linear: no nested quantifiers, bounded repetition.
STRATUM_RE = re.compile(
    r'(?<![A-Za-z0-9])(?:stratum[12]?(?:\+(?:tcp|ssl|tls|udp))?|ethstratum\+(?:tcp|ssl|tls)|ethproxy\+(?:tcp|ssl|tls)'
    r'|nicehash\+(?:tcp|ssl))://[^\s\'"<>]{0,255}', re.IGNORECASE)
HOST_TOKEN_SPLIT_RE = re.compile(r'[^a-z0-9.-]+')

WALLET_PATTERNS = (
    ('monero', re.compile(r'[48][0-9AB][1-9A-HJ-NP-Za-km-z]{93}(?:[1-9A-HJ-NP-Za-km-z]{11})?')),
    ('ethereum', re.compile(r'0x[0-9a-fA-F]{40}')),
    ('bitcoin', re.compile(r'[13][a-km-zA-HJ-NP-Z1-9]{25,34}|bc1[02-9ac-hj-np-z]{39,59}')),
    ('litecoin', re.compile(r'[LM][1-9A-HJ-NP-Za-km-z]{26,33}|ltc1[02-9ac-hj-np-z]{39,59}')),
    ('ravencoin', re.compile(r'R[1-9A-HJ-NP-Za-km-z]{33}')),
    ('ergo', re.compile(r'9[1-9A-HJ-NP-Za-km-z]{50}')),
    ('kaspa', re.compile(r'kaspa:[a-z0-9]{61,63}')),
)

# Options whose value is a pool, a wallet/user, or an algorithm.  Long and short spellings of
# xmrig, T-Rex, lolMiner, NBMiner, GMiner, PhoenixMiner, Claymore, TeamRedMiner, SRBMiner, BzMiner,
# ethminer, ccminer/cpuminer, nanominer and WildRig.
POOL_FLAGS = frozenset(('-o', '--url', '--pool', '-pool', '--server', '-epool', '-dpool', '-zpool', '-P', '--pool1',
                        '-uri', '--uri', '--stratum', '--pool-url', '--pool_url', '-s', '--host'))
WALLET_FLAGS = frozenset(('-u', '--user', '--wallet', '-wal', '-ewal', '-dwal', '-zwal', '-O', '--address', '--username',
                          '-user', '--login', '--wallet-address', '--wallet_address', '--ton-wallet', '--pubkey', '-w'))
ALGO_FLAGS = frozenset(('-a', '--algo', '--algorithm', '-algo', '--algorithm1', '--algo1', '--dual-algo'))
COIN_FLAGS = frozenset(('--coin', '-coin'))
# Options that no legitimate GPU program has: any one of them is enough.
MINER_ONLY_FLAGS = frozenset((
    '--donate-level', '--donate-over-proxy', '--nicehash', '-epool', '-ewal', '-eworker', '-esm', '-dpool', '-dwal',
    '--lhr-tune', '--lhr-autotune-mode', '--lhr-autotune', '--rig-id', '--cuda-loader', '--randomx-1gb-pages',
    '--randomx-mode', '--randomx-no-numa', '--cpu-priority', '--tls-fingerprint', '--dualmode', '--dual-algo',
    '--fee-off', '--no-watchdog-fee', '--cuda-bfactor', '--cuda-bsleep', '--pers', '--coin-fee',
))

ALGORITHMS = frozenset((
    'rx/0', 'rx/wow', 'rx/arq', 'rx/graft', 'rx/sfx', 'rx/keva', 'rx/yada', 'randomx', 'randomxmonero', 'randomarq', 'randomwow',
    'cn/0', 'cn/1', 'cn/2', 'cn/r', 'cn/fast', 'cn/half', 'cn/xao', 'cn/rto', 'cn/rwz', 'cn/zls', 'cn/double', 'cn/ccx',
    'cn/upx2', 'cn-lite/1', 'cn-heavy/0', 'cn-heavy/tube', 'cn-heavy/xhv', 'cn-pico', 'cn-pico/tlo', 'cryptonight',
    'cryptonight_heavy', 'cryptonight_v7', 'cryptonight_r', 'argon2/chukwa', 'argon2/chukwav2', 'argon2/wrkz', 'astrobwt',
    'astrobwt/v2', 'kawpow', 'ethash', 'etchash', 'ethashb3', 'autolykos', 'autolykos2', 'kheavyhash', 'heavyhash',
    'octopus', 'firopow', 'progpow', 'progpowz', 'progpow-veil', 'equihash', 'equihash144_5', 'equihash125_4',
    'equihash192_7', 'equihash210_9', 'beamhash', 'beamhashiii', 'beamv3', 'blake3', 'alephium', 'verushash', 'x16r',
    'x16rv2', 'x16s', 'x21s', 'x25x', 'sha256d', 'scrypt', 'lyra2z', 'lyra2rev3', 'lyra2v3', 'neoscrypt', 'cuckatoo32',
    'cuckaroo29', 'cuckoo', 'cuckaroom', 'zhash', 'karlsenhash', 'pyrinhash', 'nexapow', 'dynexsolve', 'sha512256d',
    'xelishash', 'xelishashv2', 'fishhash', 'ironfish', 'ghostrider', 'mtp', 'zelhash', 'meowpow', 'evrprogpow',
    'abelhash', 'sha3x', 'qhash', 'ergo', 'kaspa', 'kawpow2', 'ethashb3', 'sha256dt', 'yespower', 'yescrypt',
))
# Values of --coin (with a pool option, a miner flag set).
COINS = frozenset(('monero', 'xmr', 'eth', 'etc', 'ethereum', 'rvn', 'ravencoin', 'erg', 'ergo', 'kas', 'kaspa', 'zil', 'flux',
                   'nexa', 'alph', 'ton', 'firo', 'beam', 'zec', 'zcash', 'btg', 'cfx', 'conflux', 'neoxa', 'clore', 'arq',
                   'arqma', 'dero', 'wow', 'wownero', 'kls', 'karlsen', 'pyi', 'xna', 'ltc', 'doge', 'btc', 'bch'))
ALGORITHM_PREFIXES = ('rx/', 'cn/', 'cn-', 'cryptonight', 'equihash', 'argon2/', 'progpow', 'lyra2', 'cuckat', 'cuckar')

# Executable and process names of GPU (and a few CPU) miners.  Compared lower-case against the
# basename of argv[0], the process name and the executable, with a trailing .exe removed.
MINER_NAMES = frozenset((
    'xmrig', 'xmrig-cuda', 'xmrig-nvidia', 'xmrig-amd', 'xmr-stak', 'xmr-stak-rx', 'xmr-stak-cpu', 't-rex', 'trex',
    'nbminer', 'lolminer', 'phoenixminer', 'gminer', 'miner', 'ethminer', 'kawpowminer', 'nanominer', 'teamredminer',
    'bminer', 'ethdcrminer64', 'claymore', 'srbminer-multi', 'srbminer', 'wildrig', 'wildrig-multi', 'rigel', 'bzminer',
    'onezerominer', 'miniz', 'ccminer', 'cpuminer', 'cpuminer-opt', 'minerd', 'cgminer', 'bfgminer', 'sgminer',
    'z-enemy', 'cryptodredge', 'excavator', 'nheqminer', 'progpowminer', 'hellminer', 'gpuminer', 'xmr-node-proxy',
    'xmrig-proxy', 'kthreaddk', 'kdevtmpfsi', 'kinsing', 'sysupdate', 'networkservice', 'dbused',
))

# Well-known mining pool ports.  Generic service ports from public lists (25, 8000, 8001, 8008,
# 8080, 8118, 8888, 8899) are left out on purpose: on an ML cluster they are Jupyter, TensorBoard
# or a model server.  A port only counts towards a public address (see PRIVATE_NETWORKS).
POOL_PORTS = frozenset((
    1111, 2222, 3032, 3333, 3334, 3335, 3336, 3357, 3956, 4242, 4444, 4445, 5555, 5556, 5588, 5730, 6060, 6099, 6666,
    7777, 7778, 8866, 9000, 9999, 10128, 10300, 10343, 14433, 14444, 16161, 17777, 20535, 45560, 45700,
))

# Pool domains (suffix match on a host name): lists go stale, extend them with ``pools``.
POOL_DOMAINS = frozenset((
    'supportxmr.com', 'nanopool.org', '2miners.com', 'f2pool.com', 'hashvault.pro', 'moneroocean.stream', 'c3pool.com',
    'c3pool.org', 'herominers.com', 'unmineable.com', 'nicehash.com', 'luckpool.net', 'zpool.ca', 'ethermine.org',
    'flexpool.io', 'hiveon.net', 'hiveon.com', 'minexmr.com', 'xmrpool.eu', 'monerohash.com', 'woolypooly.com',
    'kryptex.network', 'k1pool.com', 'viabtc.com', 'antpool.com', 'poolin.com', 'binance.com', 'emcd.io',
    'dxpool.com', 'prohashing.com', 'miningpoolhub.com', 'suprnova.cc', 'zergpool.com', 'mining-dutch.nl',
    'xmrfast.com', 'gulf.moneroocean.stream', 'pool.hashvault.pro', 'rplant.xyz', 'acc-pool.pw', 'minergate.com',
    'crazypool.org', 'ezil.me', 'sparkpool.com', 'dwarfpool.com', 'miningrigrentals.com',
))

# Networks that are not "public" for the pool-port rule: loopback, RFC 1918, link-local, CGNAT,
# unique-local and unspecified.  Documentation ranges count as public (tests use them).
PRIVATE_NETWORKS = ('0.0.0.0/8', '10.0.0.0/8', '100.64.0.0/10', '127.0.0.0/8', '169.254.0.0/16', '172.16.0.0/12',
                    '192.168.0.0/16', '::/128', '::1/128', 'fe80::/10', 'fc00::/7')

# Environment variables of mining scripts.  The value matters for some of them.
MINER_ENV_KEYS = frozenset(('GPU_MAX_HEAP_SIZE', 'GPU_MAX_ALLOC_PERCENT', 'GPU_SINGLE_ALLOC_PERCENT', 'GPU_USE_SYNC_OBJECTS',
                            'GPU_FORCE_64BIT_PTR', 'XMRIG_CONFIG', 'MINER_WALLET', 'MINING_POOL', 'POOL_URL', 'WALLET'))
MINER_ENV_VALUES = {'CUDA_DISABLE_CONTROL': ('1', 'true', 'yes', 'on'), 'HISTFILE': ('/dev/null',)}

# Libraries whose presence in /proc/PID/maps says "this is ML work": a substring of a mapped
# library's basename.
ML_LIBRARIES = ('libcudnn', 'libnccl', 'librccl', 'libmiopen', 'libtorch', 'libc10', 'libtensorflow', 'libtf_', 'libxla',
                'xla_extension', 'libjax', 'jaxlib', 'libonnxruntime', 'libnvinfer', 'libtensorrt', 'libmxnet', 'libpaddle',
                'libcaffe2', 'libtriton', 'libvllm', 'libcublas', 'flash_attn', 'libmpi_cuda', 'libcudf', 'libcuml',
                'libcugraph', 'librmm', 'libggml', 'libllama', 'libctranslate2', 'libdali', 'libnvjpeg2k', 'libcutensor')

# Process names (of an ancestor) that make a GPU job suspicious: web servers and schedulers.
# Python application servers (gunicorn, uvicorn, uwsgi) are absent on purpose: they serve models.
WEB_SERVERS = frozenset(('nginx', 'apache2', 'httpd', 'lighttpd', 'php-fpm', 'php-cgi', 'php', 'caddy', 'tomcat',
                         'catalina.sh', 'java-tomcat', 'iis', 'w3wp', 'jetty', 'weblogic', 'redis-server', 'postgres',
                         'mysqld', 'mongod', 'elasticsearch', 'docker-proxy'))
CRON_NAMES = frozenset(('cron', 'crond', 'anacron', 'atd', 'fcron', 'cronie', 'systemd-cron', 'busybox-crond'))
PIPE_TO_SHELL_RE = re.compile(r'(?:curl|wget|fetch|python[0-9.]*\s+-c)\b[^|;&]{0,2000}\|\s*(?:sudo\s+)?(?:ba|da|z|k|a)?sh\b')

# Interpreters and tools that argv[0] may claim to be, and the executable basenames that may
# back them (compared as prefixes, lower-case).
MASQUERADE_CLAIMS = (
    (('python', 'python2', 'python3', 'ipython', 'ipython3', 'jupyter', 'jupyter-lab', 'jupyter-notebook', 'torchrun',
      'accelerate', 'deepspeed'), ('python', 'pypy', 'uwsgi', 'ipython', 'jupyter', 'torchrun', 'accelerate',
                                   'deepspeed', 'pytest')),
    (('java',), ('java',)),
    (('node', 'nodejs'), ('node',)),
    (('bash', 'sh', 'dash', 'zsh'), ('bash', 'sh', 'dash', 'zsh', 'busybox')),
    (('perl',), ('perl',)),
    (('ruby',), ('ruby',)),
    (('julia',), ('julia',)),
    (('r', 'rscript'), ('r', 'rscript', 'exec')),
)
SYSTEM_DAEMON_NAMES = frozenset(('sshd', 'systemd', 'init', 'kthreadd', 'kworker', 'ksoftirqd', 'dbus-daemon', 'cron', 'crond',
                                 'rsyslogd', 'systemd-journald', 'systemd-udevd', 'agetty', 'containerd', 'dockerd', 'kubelet',
                                 'nvidia-persistenced', 'nv-hostengine'))

# Hidden directory names that are ordinary homes of toolchains and environments.  ``.local`` and
# ``.cache`` are benign only with one of the listed next components.
BENIGN_DOT_DIRS = frozenset(('.conda', '.pyenv', '.cargo', '.julia', '.juliaup', '.vscode-server', '.cursor-server', '.nvm',
                             '.rustup', '.mamba', '.micromamba', '.pixi', '.venv', '.virtualenvs', '.asdf', '.sdkman',
                             '.linuxbrew', '.nix-profile', '.guix-profile', '.spack', '.tox', '.nox', '.miniconda3',
                             '.anaconda3', '.rye', '.local', '.cache'))
BENIGN_DOT_SUBDIRS = {'.local': ('bin', 'share', 'lib', 'pipx'), '.cache': ('pypoetry', 'uv', 'bazel', 'pip', 'pre-commit')}
TEMP_DIRS = ('/tmp/', '/var/tmp/', '/dev/shm/', '/run/shm/', '/dev/mqueue/')

# Behavioural windows.
FLAT_UTIL_MIN_PCT = 95.0
FLAT_UTIL_MAX_COV = 0.03
FLAT_MEM_MAX_FRACTION = 0.25
WINDOW_S = 1800.0
MIN_SAMPLES = 10
