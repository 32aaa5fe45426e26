/*
 * nvml_shim.c - a fake libnvidia-ml.so.1 for tests (gpufleet.reclaim simulator).
 *
 * It answers the NVML C API that nvidia-ml-py (pynvml), gpustat and nvitop use from the
 * simulator state file named by $GPU_SIM_STATE (JSON, schema 1, see docs/design/contracts.md).
 * The file is re-read whenever its (st_dev, st_ino, st_mtime, st_size) changes; that is checked
 * on every API call.  One mutex serialises every call (state reload included).
 *
 * Semantics worth knowing:
 *  - nvmlInit* returns NVML_ERROR_DRIVER_NOT_LOADED when $GPU_SIM_STATE is unset, unreadable,
 *    not valid JSON, or its "vendor" is not "nvidia".  A state that turns bad after init makes
 *    every call answer NVML_ERROR_UNKNOWN until it is good again.
 *  - A process entry is listed while its pid lives (/proc/PID/stat exists, not a zombie, field 22
 *    equals the recorded "starttime").  Its memory counts as used per the contract's rules, read
 *    the way tests/sim/gpusim_state.py reads them: the optional "children_starttime" (parallel to
 *    "children") and "supervisor_starttime" are checked when present, and a child without one
 *    must not have started before its entry's pid.  Device used memory is capped at the total.
 *  - A "lost" GPU answers NVML_ERROR_GPU_IS_LOST to everything except the identity-free calls:
 *    count, handle lookups, nvmlDeviceGetIndex, nvmlDeviceIsMigDeviceHandle, drain state query.
 *  - "no_permission" makes the process lists and process utilization answer NO_PERMISSION.
 *  - Drain: nvmlDeviceQueryDrainState reports the state's "drain".  nvmlDeviceModifyDrainState
 *    answers NO_PERMISSION unless geteuid() == 0, and NOT_SUPPORTED for root: the state file is
 *    read-only for the shim (only gpusim writes it).
 *  - "driver": "r470" makes the *_v3 process lists and nvmlDeviceGetMemoryInfo_v2 answer
 *    NVML_ERROR_FUNCTION_NOT_FOUND.  Built with -DSIM_R470, the library does not export those
 *    symbols at all, like a real R470 driver.
 *  - nvmlDeviceGetConfComputeMemSizeInfo and nvmlDeviceGetRunningProcessDetailList are both
 *    absent on purpose: nvitop picks a 32-byte process struct when only the first one exists.
 *  - Functions not implemented here are absent (pynvml reports FunctionNotFound) or stubs that
 *    answer NVML_ERROR_NOT_SUPPORTED.
 *  - MIG (a GPU with "mig": true and a "mig_instances" list, from gpusim init --mig): MIG device handles
 *    (nvmlDeviceGetMigDeviceHandleByIndex, by "MIG-..." UUID) answer name, UUID, memory, process lists and
 *    GI/CI ids of their instance and NOT_SUPPORTED to other device queries; the board handle gives aggregate
 *    memory and processes (with GI/CI ids) to root only (NO_PERMISSION otherwise, as nvml.h documents) and no
 *    utilization; GPU-instance profiles, placements, capacity and GPU/compute instances are read, and created and
 *    destroyed (root only) by running `gpusim _mig`, the state's one writer (the shim never writes the state).
 *  - Fault injection: $GPUSIM_NVML_SEGFAULT="FUNCTION[:N][@main|@child]" makes the Nth call (default 1)
 *    of the NVML function FUNCTION in this process die of SIGSEGV, as a crashing vendor library does
 *    ("*" counts every call).  Calls are counted per process; nothing else changes.  "@main" / "@child":
 *    only in processes that are not / are a watchdog child of the core ($_GPUFLEET_WATCHDOG set).
 */
#define _GNU_SOURCE   /* dladdr: where this library lives, to find gpusim next to it */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ NVML types */

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_IN_USE 19
#define NVML_ERROR_INSUFFICIENT_RESOURCES 23
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NVML_NO_INSTANCE 0xFFFFFFFFu
#define NVML_MEMORY_V2_VERSION 0x02000028u
#define NVML_TEMPERATURE_V1_VERSION 0x0100000Cu
#define MIB 1048576ULL

typedef struct nvmlDevice_st { unsigned int slot; } *nvmlDevice_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v2_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType, nvmlReturn;
    union { double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal; long long sllVal; } value;
} nvmlFieldValue_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;
typedef struct nvmlGpuInstance_st { unsigned slot, mig; } *nvmlGpuInstance_t;
typedef struct nvmlComputeInstance_st { unsigned slot, mig; } *nvmlComputeInstance_t;
typedef struct { unsigned int start, size; } nvmlGpuInstancePlacement_t;
typedef struct {
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount;
    unsigned int decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;
typedef struct {
    unsigned int version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount;
    unsigned int decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;
typedef struct {
    nvmlDevice_t device;
    unsigned int id, profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;
typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id, profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

#define NVML_GPU_INSTANCE_PROFILE_INFO_V2_VERSION 0x02000098u
#define NVML_GPU_INSTANCE_PROFILE_COUNT 0x12u

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define EVENT_SBE 0x1ULL
#define EVENT_DBE 0x2ULL
#define EVENT_XID 0x8ULL

/* C99 compile-time layout checks (the ABI pynvml expects). */
#define LAYOUT_CHECK(name, cond) typedef char layout_check_##name[(cond) ? 1 : -1]
LAYOUT_CHECK(mem_v1, sizeof(nvmlMemory_t) == 24);
LAYOUT_CHECK(mem_v2, sizeof(nvmlMemory_v2_t) == 40);
LAYOUT_CHECK(temp_v1, sizeof(nvmlTemperature_t) == 12);
LAYOUT_CHECK(pci, sizeof(nvmlPciInfo_t) == 68);
LAYOUT_CHECK(proc_v1, sizeof(nvmlProcessInfo_v1_t) == 16);
LAYOUT_CHECK(proc_v2, sizeof(nvmlProcessInfo_v2_t) == 24);
LAYOUT_CHECK(proc_util, sizeof(nvmlProcessUtilizationSample_t) == 32);
LAYOUT_CHECK(field_value, sizeof(nvmlFieldValue_t) == 40);
LAYOUT_CHECK(event_data, sizeof(nvmlEventData_t) == 32);
LAYOUT_CHECK(gi_profile_v1, sizeof(nvmlGpuInstanceProfileInfo_t) == 48);
LAYOUT_CHECK(gi_profile_v2, sizeof(nvmlGpuInstanceProfileInfo_v2_t) == 152);
LAYOUT_CHECK(gi_info, sizeof(nvmlGpuInstanceInfo_t) == 24);
LAYOUT_CHECK(ci_info, sizeof(nvmlComputeInstanceInfo_t) == 32);

/* ------------------------------------------------------------------ JSON (small DOM) */

enum { JT_NULL, JT_BOOL, JT_NUM, JT_STR, JT_ARR, JT_OBJ };
#define JSON_MAX_DEPTH 64

typedef struct jnode {
    int type;
    int boolean;
    double num;
    char *str;            /* JT_STR value */
    char *key;            /* member name when inside an object */
    struct jnode *child;  /* first element / member */
    struct jnode *next;   /* next sibling */
} jnode;

typedef struct { const char *p, *end; int depth; } jparser;

static void jfree(jnode *n)
{
    while (n) {
        jnode *next = n->next;
        jfree(n->child);
        free(n->str);
        free(n->key);
        free(n);
        n = next;
    }
}

static void jskip_ws(jparser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static int jlit(jparser *ps, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0)
        return 0;
    ps->p += n;
    return 1;
}

static int hex4(const char *s, unsigned *out)
{
    unsigned v = 0;
    int i;
    for (i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Parses a JSON string at ps->p (which points at the opening quote); returns a malloc'd UTF-8
 * string or NULL on error.  \u0000 becomes '?' so that C strings stay whole. */
static char *jparse_string(jparser *ps)
{
    size_t cap = 16, len = 0;
    char *out;
    if (ps->p >= ps->end || *ps->p != '"')
        return NULL;
    ps->p++;
    out = malloc(cap);
    if (!out)
        return NULL;
    for (;;) {
        unsigned cp;
        unsigned char c;
        if (len + 5 > cap) {
            char *bigger = realloc(out, cap * 2);
            if (!bigger) goto fail;
            out = bigger;
            cap *= 2;
        }
        if (ps->p >= ps->end) goto fail;
        c = (unsigned char)*ps->p++;
        if (c == '"') break;
        if (c < 0x20) goto fail;
        if (c != '\\') { out[len++] = (char)c; continue; }
        if (ps->p >= ps->end) goto fail;
        c = (unsigned char)*ps->p++;
        switch (c) {
        case '"': case '\\': case '/': out[len++] = (char)c; continue;
        case 'b': out[len++] = '\b'; continue;
        case 'f': out[len++] = '\f'; continue;
        case 'n': out[len++] = '\n'; continue;
        case 'r': out[len++] = '\r'; continue;
        case 't': out[len++] = '\t'; continue;
        case 'u': break;
        default: goto fail;
        }
        if (ps->end - ps->p < 4 || !hex4(ps->p, &cp)) goto fail;
        ps->p += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {          /* surrogate pair */
            unsigned lo;
            if (ps->end - ps->p < 6 || ps->p[0] != '\\' || ps->p[1] != 'u' || !hex4(ps->p + 2, &lo) ||
                lo < 0xDC00 || lo > 0xDFFF)
                goto fail;
            ps->p += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            goto fail;
        }
        if (cp == 0) {
            out[len++] = '?';
        } else if (cp < 0x80) {
            out[len++] = (char)cp;
        } else if (cp < 0x800) {
            out[len++] = (char)(0xC0 | (cp >> 6));
            out[len++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out[len++] = (char)(0xE0 | (cp >> 12));
            out[len++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[len++] = (char)(0x80 | (cp & 0x3F));
        } else {
            out[len++] = (char)(0xF0 | (cp >> 18));
            out[len++] = (char)(0x80 | ((cp >> 12) & 0x3F));
            out[len++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[len++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    out[len] = '\0';
    return out;
fail:
    free(out);
    return NULL;
}

static int jparse_number(jparser *ps, double *out)
{
    const char *s = ps->p;
    char buf[64];
    size_t n;
    if (s < ps->end && *s == '-') s++;
    if (s >= ps->end) return 0;
    if (*s == '0') s++;
    else if (*s >= '1' && *s <= '9') while (s < ps->end && *s >= '0' && *s <= '9') s++;
    else return 0;
    if (s < ps->end && *s == '.') {
        s++;
        if (s >= ps->end || *s < '0' || *s > '9') return 0;
        while (s < ps->end && *s >= '0' && *s <= '9') s++;
    }
    if (s < ps->end && (*s == 'e' || *s == 'E')) {
        s++;
        if (s < ps->end && (*s == '+' || *s == '-')) s++;
        if (s >= ps->end || *s < '0' || *s > '9') return 0;
        while (s < ps->end && *s >= '0' && *s <= '9') s++;
    }
    n = (size_t)(s - ps->p);
    if (n >= sizeof(buf)) return 0;
    memcpy(buf, ps->p, n);
    buf[n] = '\0';
    *out = strtod(buf, NULL);
    ps->p = s;
    return 1;
}

static jnode *jparse_value(jparser *ps)
{
    jnode *n;
    jskip_ws(ps);
    if (ps->p >= ps->end)
        return NULL;
    n = calloc(1, sizeof(*n));
    if (!n)
        return NULL;
    switch (*ps->p) {
    case 'n': n->type = JT_NULL; if (!jlit(ps, "null")) goto fail; return n;
    case 't': n->type = JT_BOOL; n->boolean = 1; if (!jlit(ps, "true")) goto fail; return n;
    case 'f': n->type = JT_BOOL; if (!jlit(ps, "false")) goto fail; return n;
    case '"':
        n->type = JT_STR;
        if (!(n->str = jparse_string(ps))) goto fail;
        return n;
    case '[': case '{': {
        int is_obj = *ps->p == '{';
        char close = is_obj ? '}' : ']';
        jnode **tail = &n->child;
        n->type = is_obj ? JT_OBJ : JT_ARR;
        if (++ps->depth > JSON_MAX_DEPTH) goto fail;
        ps->p++;
        jskip_ws(ps);
        if (ps->p < ps->end && *ps->p == close) { ps->p++; ps->depth--; return n; }
        for (;;) {
            char *key = NULL;
            jnode *item;
            if (is_obj) {
                jskip_ws(ps);
                if (!(key = jparse_string(ps))) goto fail;
                jskip_ws(ps);
                if (ps->p >= ps->end || *ps->p != ':') { free(key); goto fail; }
                ps->p++;
            }
            if (!(item = jparse_value(ps))) { free(key); goto fail; }
            item->key = key;
            *tail = item;
            tail = &item->next;
            jskip_ws(ps);
            if (ps->p < ps->end && *ps->p == ',') { ps->p++; continue; }
            if (ps->p < ps->end && *ps->p == close) { ps->p++; ps->depth--; return n; }
            goto fail;
        }
    }
    default:
        n->type = JT_NUM;
        if (!jparse_number(ps, &n->num)) goto fail;
        return n;
    }
fail:
    jfree(n);
    return NULL;
}

static jnode *jparse_document(const char *text, size_t len)
{
    jparser ps;
    jnode *root;
    ps.p = text;
    ps.end = text + len;
    ps.depth = 0;
    root = jparse_value(&ps);
    if (!root)
        return NULL;
    jskip_ws(&ps);
    if (ps.p != ps.end) {   /* trailing garbage */
        jfree(root);
        return NULL;
    }
    return root;
}

static const jnode *jget(const jnode *obj, const char *key)
{
    const jnode *c, *found = NULL;
    if (!obj || obj->type != JT_OBJ)
        return NULL;
    for (c = obj->child; c; c = c->next)   /* the last duplicate wins, as in Python's json */
        if (c->key && strcmp(c->key, key) == 0)
            found = c;
    return found;
}

/* Number member: missing or of another type -> dflt; null -> NAN (meaning "not available"). */
static double jnum(const jnode *obj, const char *key, double dflt)
{
    const jnode *v = jget(obj, key);
    if (!v) return dflt;
    if (v->type == JT_NULL) return NAN;
    if (v->type == JT_NUM && isfinite(v->num)) return v->num;
    if (v->type == JT_BOOL) return v->boolean;
    return dflt;
}

static int jbool(const jnode *obj, const char *key, int dflt)
{
    const jnode *v = jget(obj, key);
    if (v && v->type == JT_BOOL) return v->boolean;
    if (v && v->type == JT_NUM) return v->num != 0;
    return dflt;
}

static void jstr(const jnode *obj, const char *key, char *buf, size_t size, const char *dflt)
{
    const jnode *v = jget(obj, key);
    snprintf(buf, size, "%s", v && v->type == JT_STR ? v->str : dflt);
}

/* ------------------------------------------------------------------ simulator state */

#define SIM_MAX_GPUS 64
#define SIM_MAX_EVENTS 64
#define SIM_MAX_STATE_BYTES (64u << 20)
#define SIM_MAX_MIG 8                 /* MIG devices per GPU (7 on every MIG board) */
#define SIM_MAX_PROFILES 12
#define SIM_MAX_PLACEMENTS 8
#define SIM_MIG_COMPUTE_SLICES 7
enum { PT_COMPUTE, PT_GRAPHICS, PT_MPS };

/* A GPU instance profile of the board (the state's "mig_profiles", written by gpusim from its table). */
typedef struct {
    char name[32];
    unsigned enum_id, id, slices, memory_slices, instance_count, sm, ce, dec, enc, jpeg, ofa, ci_enum;
    double memory_mib;
    unsigned nplacements, placements[SIM_MAX_PLACEMENTS];
} sim_profile;

/* One GPU instance and its compute instance, a MIG device (the state's "mig_instances"); has_ci 0: a GPU
 * instance without compute instance (its "ci" is null), which is no MIG device.  Handles are keyed by the GI id. */
typedef struct {
    int has_ci;
    unsigned gi, ci, placement;
    int profile;                  /* index into the GPU's profiles; -1: not in the table */
    double memory_mib;
    char uuid[96], profile_name[32];
} sim_mig;

typedef struct {
    int index;
    char uuid[96], name[96], pci_bus_id[32];
    unsigned domain, bus, device, pci_device_id;
    unsigned minor;
    double total_mib, reserved_mib, leaked_mib, context_overhead_mib;
    double util_pct, mem_util_pct, temp_c, power_w, power_limit_w, fan_pct;  /* NAN: N/A */
    double ecc_corrected, ecc_uncorrected;
    double rr_correctable, rr_uncorrectable;
    int rr_pending, rr_failure;
    int cc_major, cc_minor;
    int persistence, mig, lost, no_permission, drain;
    double recovery_action;       /* NAN: the field is NOT_SUPPORTED */
    double hang_until;            /* epoch seconds: per-device calls block until then */
    double clocks_event_reasons;
    /* the driver's Xid event queue (the most recent SIM_MAX_EVENTS of the state's "xid_events") */
    unsigned nevents;
    double event_seq[SIM_MAX_EVENTS];
    unsigned event_code[SIM_MAX_EVENTS];
    /* MIG: the layout is active while "mig" is true and "mig_instances" exists (gpusim init --mig) */
    int mig_layout;
    unsigned nprofiles, nmig;
    sim_profile profiles[SIM_MAX_PROFILES];
    sim_mig migs[SIM_MAX_MIG];
} sim_gpu;

typedef struct {
    unsigned pid;
    double starttime;             /* NAN: not recorded, no pid-reuse check */
    int gpu, type;
    double used_mib;              /* NAN: NVML_VALUE_NOT_AVAILABLE */
    double util_pct, mem_util_pct;
    struct sim_child { unsigned pid; double starttime; } *children;  /* starttime NAN: not recorded */
    size_t nchildren;
    unsigned supervisor_pid;      /* 0: none */
    double supervisor_starttime;  /* NAN: not recorded */
    double exited_at;             /* NAN: not written yet */
    int on_mig;                   /* runs on the MIG instance mig_gi/mig_ci of its GPU */
    unsigned mig_gi, mig_ci;
} sim_proc;

typedef struct {
    int ok, r470;
    char driver_version[80], nvml_version[80];
    int cuda_version;
    double release_delay_ms;
    sim_gpu gpus[SIM_MAX_GPUS];
    unsigned ngpus;
    sim_proc *procs;
    size_t nprocs;
} sim_state;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static sim_state g_state;
static int g_have_key;
static struct stat g_key;
static unsigned g_refcount;
static struct nvmlDevice_st g_handles[SIM_MAX_GPUS];
static struct nvmlDevice_st g_mig_handles[SIM_MAX_GPUS][SIM_MAX_MIG];
static struct nvmlGpuInstance_st g_gi_handles[SIM_MAX_GPUS][SIM_MAX_MIG];
static struct nvmlComputeInstance_st g_ci_handles[SIM_MAX_GPUS][SIM_MAX_MIG];

static unsigned to_uint(double v)
{
    if (!(v > 0)) return 0;                 /* also NAN */
    if (v >= 4294967295.0) return 4294967295u;
    return (unsigned)(v + 0.5);
}

static unsigned long long mib_to_bytes(double mib)
{
    if (!(mib > 0)) return 0;
    if (mib > 1e12) mib = 1e12;
    return (unsigned long long)mib * MIB;
}

/* "00000000:07:00.0", "0000:07:00.0" or "07:00.0" -> domain, bus, device; 1 on success. */
static int parse_bus_id(const char *s, unsigned *dom, unsigned *bus, unsigned *dev)
{
    unsigned fn;
    if (sscanf(s, "%x:%x:%x.%x", dom, bus, dev, &fn) == 4)
        return 1;
    *dom = 0;
    return sscanf(s, "%x:%x.%x", bus, dev, &fn) == 3;
}

static void state_clear(sim_state *s)
{
    size_t i;
    for (i = 0; i < s->nprocs; i++)
        free(s->procs[i].children);
    free(s->procs);
    memset(s, 0, sizeof(*s));
}

/* The last SIM_MAX_EVENTS entries {seq, code} of the GPU's event queue, in order. */
static void load_events(const jnode *arr, sim_gpu *g)
{
    const jnode *c;
    size_t n = 0, skip;
    g->nevents = 0;
    if (!arr || arr->type != JT_ARR)
        return;
    for (c = arr->child; c; c = c->next) n++;
    skip = n > SIM_MAX_EVENTS ? n - SIM_MAX_EVENTS : 0;
    for (c = arr->child; c; c = c->next) {
        double seq, code;
        if (skip) { skip--; continue; }
        if (c->type != JT_OBJ) continue;
        seq = jnum(c, "seq", NAN);
        code = jnum(c, "code", NAN);
        if (isnan(seq) || isnan(code)) continue;
        g->event_seq[g->nevents] = seq;
        g->event_code[g->nevents++] = to_uint(code);
    }
}

/* The GPU's MIG profiles and instances ("mig_profiles", "mig_instances"); absent keys: no MIG layout. */
static void load_mig(const jnode *o, sim_gpu *g)
{
    const jnode *profiles = jget(o, "mig_profiles"), *insts = jget(o, "mig_instances"), *c, *pl;
    unsigned i;
    g->nprofiles = g->nmig = 0;
    g->mig_layout = insts && insts->type == JT_ARR;
    if (profiles && profiles->type == JT_ARR)
        for (c = profiles->child; c && g->nprofiles < SIM_MAX_PROFILES; c = c->next) {
            sim_profile *p = &g->profiles[g->nprofiles];
            if (c->type != JT_OBJ) continue;
            memset(p, 0, sizeof(*p));
            jstr(c, "name", p->name, sizeof(p->name), "");
            p->enum_id = to_uint(jnum(c, "enum", 0));
            p->id = to_uint(jnum(c, "id", 0));
            p->slices = to_uint(jnum(c, "slices", 1));
            p->memory_slices = to_uint(jnum(c, "memory_slices", 1));
            p->instance_count = to_uint(jnum(c, "instance_count", 1));
            p->sm = to_uint(jnum(c, "multiprocessors", 0));
            p->ce = to_uint(jnum(c, "copy_engines", 0));
            p->dec = to_uint(jnum(c, "decoders", 0));
            p->enc = to_uint(jnum(c, "encoders", 0));
            p->jpeg = to_uint(jnum(c, "jpegs", 0));
            p->ofa = to_uint(jnum(c, "ofas", 0));
            p->ci_enum = to_uint(jnum(c, "ci_enum", 0));
            p->memory_mib = jnum(c, "memory_mib", 0);
            pl = jget(c, "placements");
            if (pl && pl->type == JT_ARR)
                for (pl = pl->child; pl && p->nplacements < SIM_MAX_PLACEMENTS; pl = pl->next)
                    if (pl->type == JT_NUM) p->placements[p->nplacements++] = to_uint(pl->num);
            g->nprofiles++;
        }
    if (!g->mig_layout)
        return;
    for (c = insts->child; c && g->nmig < SIM_MAX_MIG; c = c->next) {
        sim_mig *m = &g->migs[g->nmig];
        if (c->type != JT_OBJ) continue;
        memset(m, 0, sizeof(*m));
        m->gi = to_uint(jnum(c, "gi", 0));
        if (m->gi == 0 || m->gi >= SIM_MAX_MIG) continue;   /* gpusim numbers GPU instances 1..7 */
        m->has_ci = !isnan(jnum(c, "ci", NAN));
        m->ci = to_uint(jnum(c, "ci", 0));
        m->placement = to_uint(jnum(c, "placement", 0));
        m->memory_mib = jnum(c, "memory_mib", 0);
        jstr(c, "uuid", m->uuid, sizeof(m->uuid), "");
        jstr(c, "profile", m->profile_name, sizeof(m->profile_name), "");
        m->profile = -1;
        for (i = 0; i < g->nprofiles; i++)
            if (strcmp(g->profiles[i].name, m->profile_name) == 0) m->profile = (int)i;
        g->nmig++;
    }
}

static void load_gpu(const jnode *o, unsigned pos, sim_gpu *g)
{
    char dflt[64];
    const jnode *rr = jget(o, "remapped_rows");
    const jnode *cc = jget(o, "compute_capability");
    g->index = (int)to_uint(jnum(o, "index", pos));
    snprintf(dflt, sizeof(dflt), "GPU-53494d00-0000-4000-8000-%012x", (unsigned)g->index);
    jstr(o, "uuid", g->uuid, sizeof(g->uuid), dflt);
    jstr(o, "name", g->name, sizeof(g->name), "NVIDIA A100-SXM4-80GB");
    snprintf(dflt, sizeof(dflt), "00000000:%02X:00.0", (0x07u + (unsigned)g->index) & 0xFFu);
    jstr(o, "pci_bus_id", g->pci_bus_id, sizeof(g->pci_bus_id), dflt);
    if (!parse_bus_id(g->pci_bus_id, &g->domain, &g->bus, &g->device))
        g->domain = g->bus = g->device = 0;
    g->pci_device_id = to_uint(jnum(o, "pci_device_id", (double)0x20B210DEu));
    g->minor = to_uint(jnum(o, "minor", g->index));
    g->total_mib = jnum(o, "memory_total_mib", 81559);
    if (isnan(g->total_mib)) g->total_mib = 0;
    g->reserved_mib = jnum(o, "memory_reserved_mib", 0);
    g->leaked_mib = jnum(o, "leaked_mib", 0);
    g->context_overhead_mib = jnum(o, "context_overhead_mib", 0);
    g->util_pct = jnum(o, "util_pct", 0);
    g->mem_util_pct = jnum(o, "mem_util_pct", 0);
    g->temp_c = jnum(o, "temp_c", 34);
    g->power_w = jnum(o, "power_w", 61.0);
    g->power_limit_w = jnum(o, "power_limit_w", 400.0);
    g->fan_pct = jnum(o, "fan_pct", NAN);
    g->persistence = jbool(o, "persistence", 1);
    g->mig = jbool(o, "mig", 0);
    g->ecc_uncorrected = jnum(o, "ecc_uncorrected", 0);
    g->ecc_corrected = jnum(o, "ecc_corrected", 0);
    g->rr_correctable = jnum(rr, "correctable", 0);
    g->rr_uncorrectable = jnum(rr, "uncorrectable", 0);
    g->rr_pending = jbool(rr, "pending", 0);
    g->rr_failure = jbool(rr, "failure", 0);
    g->cc_major = 8;
    g->cc_minor = 0;
    if (cc && cc->type == JT_STR)
        sscanf(cc->str, "%d.%d", &g->cc_major, &g->cc_minor);
    g->lost = jbool(o, "lost", 0);
    g->no_permission = jbool(o, "no_permission", 0);
    g->drain = jbool(o, "drain", 0);
    g->recovery_action = jnum(o, "recovery_action", NAN);
    g->hang_until = jnum(o, "hang_until", 0);
    if (isnan(g->hang_until)) g->hang_until = 0;
    g->clocks_event_reasons = jnum(o, "clocks_event_reasons", 0);
    load_events(jget(o, "xid_events"), g);
    load_mig(o, g);
}

/* Returns 0 when the entry is usable. */
static int load_proc(const jnode *o, sim_proc *p)
{
    const jnode *kids = jget(o, "children"), *starts = jget(o, "children_starttime"), *c, *st;
    char type[16];
    double pid = jnum(o, "pid", 0);
    if (!(pid >= 1 && pid <= INT_MAX))
        return -1;
    p->pid = (unsigned)pid;
    p->starttime = jnum(o, "starttime", NAN);
    p->gpu = (int)to_uint(jnum(o, "gpu", 0));
    p->used_mib = jnum(o, "used_mib", 0);
    p->util_pct = jnum(o, "util_pct", 0);
    p->mem_util_pct = jnum(o, "mem_util_pct", 0);
    jstr(o, "type", type, sizeof(type), "compute");
    p->type = strcmp(type, "graphics") == 0 ? PT_GRAPHICS : strcmp(type, "mps") == 0 ? PT_MPS : PT_COMPUTE;
    p->supervisor_pid = to_uint(jnum(o, "supervisor_pid", 0));
    p->supervisor_starttime = jnum(o, "supervisor_starttime", NAN);
    p->exited_at = jnum(o, "exited_at", NAN);
    p->on_mig = jget(o, "mig_gi") != NULL && !isnan(jnum(o, "mig_gi", NAN));
    p->mig_gi = to_uint(jnum(o, "mig_gi", 0));
    p->mig_ci = to_uint(jnum(o, "mig_ci", 0));
    if (kids && kids->type == JT_ARR) {
        size_t n = 0;
        for (c = kids->child; c; c = c->next) n++;
        p->children = n ? calloc(n, sizeof(*p->children)) : NULL;
        st = starts && starts->type == JT_ARR ? starts->child : NULL;
        for (c = kids->child; c && p->children; c = c->next, st = st ? st->next : NULL)
            if (c->type == JT_NUM && c->num >= 1 && c->num <= INT_MAX) {
                p->children[p->nchildren].pid = (unsigned)c->num;
                p->children[p->nchildren++].starttime = st && st->type == JT_NUM ? st->num : NAN;
            }
    }
    return 0;
}

static int state_from_json(const jnode *root, sim_state *s)
{
    const jnode *gpus = jget(root, "gpus"), *procs = jget(root, "processes"), *c;
    char vendor[16], driver[16];
    size_t n = 0;
    if (!root || root->type != JT_OBJ)
        return -1;
    jstr(root, "vendor", vendor, sizeof(vendor), "nvidia");
    if (strcmp(vendor, "nvidia") != 0)
        return -1;
    jstr(root, "driver", driver, sizeof(driver), "r550");
    s->r470 = strcmp(driver, "r470") == 0;
    jstr(root, "driver_version", s->driver_version, sizeof(s->driver_version), s->r470 ? "470.256.02" : "550.54.15");
    jstr(root, "nvml_version", s->nvml_version, sizeof(s->nvml_version), s->r470 ? "11.470.256.02" : "12.550.54.15");
    s->cuda_version = (int)to_uint(jnum(root, "cuda_driver_version", s->r470 ? 11040 : 12040));
    s->release_delay_ms = jnum(root, "release_delay_ms", 0);
    if (isnan(s->release_delay_ms)) s->release_delay_ms = 0;
    if (gpus && gpus->type == JT_ARR)
        for (c = gpus->child; c && s->ngpus < SIM_MAX_GPUS; c = c->next)
            if (c->type == JT_OBJ) {
                load_gpu(c, s->ngpus, &s->gpus[s->ngpus]);
                s->ngpus++;
            }
    if (procs && procs->type == JT_ARR) {
        for (c = procs->child; c; c = c->next) n++;
        s->procs = n ? calloc(n, sizeof(sim_proc)) : NULL;
        for (c = procs->child; c && s->procs; c = c->next)
            if (c->type == JT_OBJ && load_proc(c, &s->procs[s->nprocs]) == 0)
                s->nprocs++;
    }
    s->ok = 1;
    return 0;
}

static char *read_fd(int fd, size_t limit, size_t *len)
{
    size_t cap = 8192, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        ssize_t r;
        if (n == cap) {
            char *bigger = cap >= limit ? NULL : realloc(buf, cap * 2);
            if (!bigger) { free(buf); return NULL; }
            buf = bigger;
            cap *= 2;
        }
        r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { free(buf); return NULL; }
        if (r == 0) break;
        n += (size_t)r;
    }
    *len = n;
    return buf;
}

/* Re-reads the state when the file changed; call with g_lock held.  Returns g_state.ok. */
static int refresh(void)
{
    const char *path = getenv("GPU_SIM_STATE");
    struct stat st;
    int fd;
    size_t len = 0;
    char *text;
    jnode *root;
    if (!path || !*path || (fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
        g_have_key = 0;
        state_clear(&g_state);
        return 0;
    }
    if (fstat(fd, &st) != 0) {
        close(fd);
        g_have_key = 0;
        state_clear(&g_state);
        return 0;
    }
    if (g_have_key && st.st_dev == g_key.st_dev && st.st_ino == g_key.st_ino && st.st_size == g_key.st_size &&
        st.st_mtim.tv_sec == g_key.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_key.st_mtim.tv_nsec) {
        close(fd);
        return g_state.ok;
    }
    text = read_fd(fd, SIM_MAX_STATE_BYTES, &len);
    close(fd);
    state_clear(&g_state);
    g_key = st;
    g_have_key = 1;
    root = text ? jparse_document(text, len) : NULL;
    free(text);
    if (!root || state_from_json(root, &g_state) != 0)
        state_clear(&g_state);
    jfree(root);
    return g_state.ok;
}

/* ------------------------------------------------------------------ liveness */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Reads the state letter and starttime (field 22) of /proc/PID/stat; 0 on success. */
static int read_stat(unsigned pid, char *state, double *starttime)
{
    char path[64], buf[1024];
    const char *p;
    int fd, field;
    ssize_t n;
    if (pid == 0)
        return -1;
    snprintf(path, sizeof(path), "/proc/%u/stat", pid);
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return -1;
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    if (!(p = strrchr(buf, ')')))          /* comm may contain ')' and spaces */
        return -1;
    p++;
    while (*p == ' ') p++;
    *state = *p;
    for (field = 3; field < 22 && *p; field++) {   /* p is at field 3 (state) */
        while (*p && *p != ' ') p++;
        while (*p == ' ') p++;
    }
    if (!*p)
        return -1;
    *starttime = strtod(p, NULL);
    return 0;
}

/* A pid lives when /proc/PID/stat exists, it is no zombie and, when recorded, its starttime
 * equals the recorded one (else the pid was reused). */
static int pid_alive(unsigned pid, double starttime)
{
    char state;
    double start;
    if (read_stat(pid, &state, &start) != 0 || state == 'Z' || state == 'X' || state == 'x')
        return 0;
    return isnan(starttime) || start == starttime;
}

static int proc_listed(const sim_proc *p)
{
    return pid_alive(p->pid, p->starttime);
}

/* A child without a recorded starttime must at least not predate its parent (as gpusim_state). */
static int child_alive(const sim_proc *p, const struct sim_child *c)
{
    char state;
    double start;
    if (!isnan(c->starttime))
        return pid_alive(c->pid, c->starttime);
    if (read_stat(c->pid, &state, &start) != 0 || state == 'Z' || state == 'X' || state == 'x')
        return 0;
    return isnan(p->starttime) || start >= p->starttime;
}

static int proc_counts(const sim_proc *p, double now)
{
    size_t i;
    if (proc_listed(p))
        return 1;
    for (i = 0; i < p->nchildren; i++)
        if (child_alive(p, &p->children[i]))
            return 1;
    if (!isnan(p->exited_at))
        return now < p->exited_at + g_state.release_delay_ms / 1000.0;
    return p->supervisor_pid && pid_alive(p->supervisor_pid, p->supervisor_starttime);
}

static double gpu_used_mib(const sim_gpu *g)
{
    double used = 0, now = now_s();
    size_t i;
    if (g->reserved_mib > 0) used += g->reserved_mib;
    if (g->leaked_mib > 0) used += g->leaked_mib;
    for (i = 0; i < g_state.nprocs; i++) {
        const sim_proc *p = &g_state.procs[i];
        /* A real driver also uses a few MiB per context that it charges to no process
         * (measured on an H200, driver 580: 8, 14 and 25 MiB with 1, 2 and 4 processes). */
        if (p->gpu == g->index && proc_counts(p, now)) {
            if (p->used_mib > 0) used += p->used_mib;
            if (g->context_overhead_mib > 0) used += g->context_overhead_mib;
        }
    }
    return used > g->total_mib ? g->total_mib : used;
}

static int mig_active(const sim_gpu *g)
{
    return g->mig && g->mig_layout;
}

static int proc_on(const sim_proc *p, const sim_gpu *g, const sim_mig *m)
{
    return p->gpu == g->index && (!m || (p->on_mig && p->mig_gi == m->gi && p->mig_ci == m->ci));
}

/* Memory used on one MIG device: its counted entries (and the context overhead of each), capped at its size.
 * The board's figure (gpu_used_mib) already holds these entries: nothing is counted twice. */
static double mig_used_mib(const sim_gpu *g, const sim_mig *m)
{
    double used = 0, now = now_s();
    size_t i;
    for (i = 0; i < g_state.nprocs; i++) {
        const sim_proc *p = &g_state.procs[i];
        if (proc_on(p, g, m) && proc_counts(p, now)) {
            if (p->used_mib > 0) used += p->used_mib;
            if (g->context_overhead_mib > 0) used += g->context_overhead_mib;
        }
    }
    return used > m->memory_mib ? m->memory_mib : used;
}

/* Device utilization: the state's figure, or the sum of the listed processes' utilization when
 * that is higher (capped at 100), so `gpusim spawn --util 97` makes its GPU busy as a real one is. */
static double gpu_util_pct(const sim_gpu *g)
{
    double busy = 0;
    size_t i;
    if (isnan(g->util_pct))
        return g->util_pct;
    for (i = 0; i < g_state.nprocs; i++) {
        const sim_proc *p = &g_state.procs[i];
        if (p->gpu == g->index && !isnan(p->util_pct) && p->util_pct > 0 && proc_listed(p))
            busy += p->util_pct;
    }
    if (busy > 100)
        busy = 100;
    return busy > g->util_pct ? busy : g->util_pct;
}

/* ------------------------------------------------------------------ call plumbing */

/* $GPUSIM_NVML_SEGFAULT="FUNCTION[:N]": the Nth matching call of this process raises SIGSEGV
 * (the default action: the process dies, as it would on a crash inside the real library). */
static unsigned long g_fault_calls;

static void fault_point(const char *func)
{
    const char *spec = getenv("GPUSIM_NVML_SEGFAULT");
    const char *colon, *at;
    size_t len;
    unsigned long want = 1;
    if (!spec || !*spec)
        return;
    /* "@main" / "@child": only outside / inside a watchdog child of the core ($_GPUFLEET_WATCHDOG set) */
    at = strchr(spec, '@');
    if (at) {
        const char *child = getenv("_GPUFLEET_WATCHDOG");
        int in_child = child && *child;
        if ((strcmp(at + 1, "main") == 0 && in_child) || (strcmp(at + 1, "child") == 0 && !in_child))
            return;
    }
    colon = strchr(spec, ':');
    if (colon && at && colon > at)
        colon = NULL;
    len = colon ? (size_t)(colon - spec) : at ? (size_t)(at - spec) : strlen(spec);
    if (colon) {
        char *end = NULL;
        want = strtoul(colon + 1, &end, 10);
        if (!end || (*end && *end != '@') || want == 0)
            want = 1;
    }
    if (!(len == 1 && spec[0] == '*') && (strlen(func) != len || strncmp(func, spec, len) != 0))
        return;
    if (++g_fault_calls < want)
        return;
    signal(SIGSEGV, SIG_DFL);
    raise(SIGSEGV);
}

/* For public functions that hand their work to a shared helper (whose __func__ is the helper's). */
static void fault_point_named(const char *func)
{
    pthread_mutex_lock(&g_lock);
    fault_point(func);
    pthread_mutex_unlock(&g_lock);
}

#define api_begin() api_begin_at(__func__)

static nvmlReturn_t api_begin_at(const char *func)
{
    pthread_mutex_lock(&g_lock);
    fault_point(func);
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    return refresh() ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

static nvmlReturn_t api_end(nvmlReturn_t rc)
{
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The position in g->migs of GPU instance `gi`, or -1. */
static int mig_by_gi(const sim_gpu *g, unsigned gi)
{
    unsigned k;
    for (k = 0; k < g->nmig; k++)
        if (g->migs[k].gi == gi) return (int)k;
    return -1;
}

/* A board handle (*mig = NULL) or a MIG device handle (*out = its parent, *mig = the MIG device).  A MIG
 * handle whose GPU has left MIG mode or lost that device is stale: INVALID_ARGUMENT. */
static nvmlReturn_t any_lookup(nvmlDevice_t dev, const sim_gpu **out, const sim_mig **mig, int allow_lost)
{
    uintptr_t base = (uintptr_t)g_handles, mbase = (uintptr_t)g_mig_handles, p = (uintptr_t)dev;
    unsigned slot, idx = 0;
    int is_mig = 0;
    *mig = NULL;
    if (!dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (p >= base && p < base + sizeof(g_handles) && (p - base) % sizeof(g_handles[0]) == 0) {
        slot = (unsigned)((p - base) / sizeof(g_handles[0]));
    } else if (p >= mbase && p < mbase + sizeof(g_mig_handles) && (p - mbase) % sizeof(g_mig_handles[0][0]) == 0) {
        unsigned n = (unsigned)((p - mbase) / sizeof(g_mig_handles[0][0]));
        slot = n / SIM_MAX_MIG;
        idx = n % SIM_MAX_MIG;
        is_mig = 1;
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (slot >= g_state.ngpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &g_state.gpus[slot];
    if (is_mig) {
        int k = mig_by_gi(*out, idx);
        if (!mig_active(*out) || k < 0 || !(*out)->migs[k].has_ci)
            return NVML_ERROR_INVALID_ARGUMENT;
        *mig = &(*out)->migs[k];
    }
    return (*out)->lost && !allow_lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}


/* A hung driver (`gpusim hang`): a call on a GPU whose "hang_until" lies ahead sleeps until then, with
 * the lock released (other GPUs and other threads go on), then looks the GPU up again. */
static void sleep_until(double until)
{
    double left;
    while ((left = until - now_s()) > 0) {
        struct timespec ts;
        if (left > 0.1) left = 0.1;
        ts.tv_sec = 0;
        ts.tv_nsec = (long)(left * 1e9);
        nanosleep(&ts, NULL);
    }
}

static nvmlReturn_t any_lookup_wait(nvmlDevice_t dev, const sim_gpu **out, const sim_mig **mig, int allow_lost)
{
    nvmlReturn_t rc = any_lookup(dev, out, mig, allow_lost);
    double until;
    if ((rc != NVML_SUCCESS && rc != NVML_ERROR_GPU_IS_LOST) || !(*out)->hang_until)
        return rc;
    until = (*out)->hang_until;
    if (until <= now_s())
        return rc;
    pthread_mutex_unlock(&g_lock);
    sleep_until(until);
    pthread_mutex_lock(&g_lock);
    if (!refresh())
        return NVML_ERROR_UNKNOWN;
    return any_lookup(dev, out, mig, allow_lost);
}

/* A board handle only: device-level queries on a MIG device handle answer NOT_SUPPORTED. */
static nvmlReturn_t dev_lookup_wait(nvmlDevice_t dev, const sim_gpu **out, int allow_lost)
{
    const sim_mig *m = NULL;
    nvmlReturn_t rc = any_lookup_wait(dev, out, &m, allow_lost);
    return rc == NVML_SUCCESS && m ? NVML_ERROR_NOT_SUPPORTED : rc;
}

/* Body of a per-device call: `g` is the GPU, `rc` the result (starts as NVML_SUCCESS).
 * With `present` false the call behaves as a symbol the driver lacks (FUNCTION_NOT_FOUND). */
#define DEVICE_CALL_IF(present, dev, allow_lost, ...)      \
    const sim_gpu *g = NULL;                                \
    nvmlReturn_t rc = api_begin();                          \
    if (rc == NVML_SUCCESS && !(present))                   \
        rc = NVML_ERROR_FUNCTION_NOT_FOUND;                 \
    if (rc == NVML_SUCCESS)                                 \
        rc = dev_lookup_wait((dev), &g, (allow_lost));      \
    if (rc == NVML_SUCCESS) { __VA_ARGS__ }                 \
    return api_end(rc)

#define DEVICE_CALL(dev, allow_lost, ...) DEVICE_CALL_IF(1, dev, allow_lost, __VA_ARGS__)

/* The same for calls that also take a MIG device handle: `m` is the MIG device (NULL for a board). */
#define ANY_DEVICE_CALL_IF(present, dev, allow_lost, ...)  \
    const sim_gpu *g = NULL;                                \
    const sim_mig *m = NULL;                                \
    nvmlReturn_t rc = api_begin();                          \
    if (rc == NVML_SUCCESS && !(present))                   \
        rc = NVML_ERROR_FUNCTION_NOT_FOUND;                 \
    if (rc == NVML_SUCCESS)                                 \
        rc = any_lookup_wait((dev), &g, &m, (allow_lost));  \
    if (rc == NVML_SUCCESS) { __VA_ARGS__ }                 \
    return api_end(rc)

#define ANY_DEVICE_CALL(dev, allow_lost, ...) ANY_DEVICE_CALL_IF(1, dev, allow_lost, __VA_ARGS__)

/* In MIG mode the board handle gives aggregate memory and process figures only to a privileged caller
 * (nvml.h: "In MIG mode, if device handle is provided, the API returns aggregate information, only if the
 * caller has appropriate privileges"); per-instance figures come from the MIG device handles. */
#define MIG_AGGREGATE_ALLOWED(g, m) ((m) || !mig_active(g) || geteuid() == 0)

#define REQUIRE(ptr) if (!(ptr)) { rc = NVML_ERROR_INVALID_ARGUMENT; } else

static nvmlReturn_t copy_str(char *dst, unsigned length, const char *src)
{
    size_t n = strlen(src);
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

static nvmlDevice_t handle_for(unsigned slot)
{
    g_handles[slot].slot = slot;
    return &g_handles[slot];
}

static int slot_by_bus_id(const char *s)
{
    unsigned dom, bus, dev, i;
    if (!s || !parse_bus_id(s, &dom, &bus, &dev))
        return -1;
    for (i = 0; i < g_state.ngpus; i++)
        if (g_state.gpus[i].domain == dom && g_state.gpus[i].bus == bus && g_state.gpus[i].device == dev)
            return (int)i;
    return -1;
}

/* ------------------------------------------------------------------ init, system */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    (void)flags;
    pthread_mutex_lock(&g_lock);
    fault_point(__func__);
    if (refresh())
        g_refcount++;
    else
        rc = NVML_ERROR_DRIVER_NOT_LOADED;
    return api_end(rc);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        g_refcount--;
    return api_end(rc);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, becasue ECC is enabled";
    case 23: return "Insufficient resources for request";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS)
        rc = copy_str(version, length, g_state.driver_version);
    return api_end(rc);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS)
        rc = copy_str(version, length, g_state.nvml_version);
    return api_end(rc);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS) {
        REQUIRE(cudaDriverVersion) *cudaDriverVersion = g_state.cuda_version;
    }
    return api_end(rc);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ------------------------------------------------------------------ enumeration */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS) {
        REQUIRE(deviceCount) *deviceCount = g_state.ngpus;
    }
    return api_end(rc);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    unsigned i;
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
        for (i = 0; device && i < g_state.ngpus; i++)
            if ((unsigned)g_state.gpus[i].index == index) {
                *device = handle_for(i);
                rc = NVML_SUCCESS;
                break;
            }
    }
    return api_end(rc);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    unsigned i;
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS) {
        rc = uuid && device ? NVML_ERROR_NOT_FOUND : NVML_ERROR_INVALID_ARGUMENT;
        for (i = 0; rc == NVML_ERROR_NOT_FOUND && i < g_state.ngpus; i++) {
            const sim_gpu *g = &g_state.gpus[i];
            unsigned k;
            if (strcmp(g->uuid, uuid) == 0) {
                *device = handle_for(i);
                rc = NVML_SUCCESS;
            }
            for (k = 0; rc == NVML_ERROR_NOT_FOUND && mig_active(g) && k < g->nmig; k++)
                if (g->migs[k].has_ci && strcmp(g->migs[k].uuid, uuid) == 0) {   /* a MIG device's "MIG-..." UUID */
                    *device = &g_mig_handles[i][g->migs[k].gi];
                    rc = NVML_SUCCESS;
                }
        }
    }
    return api_end(rc);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    int slot;
    unsigned dom, bus, dev;
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS) {
        if (!pciBusId || !device || !parse_bus_id(pciBusId, &dom, &bus, &dev))
            rc = NVML_ERROR_INVALID_ARGUMENT;
        else if ((slot = slot_by_bus_id(pciBusId)) < 0)
            rc = NVML_ERROR_NOT_FOUND;
        else
            *device = handle_for((unsigned)slot);
    }
    return api_end(rc);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *index)
{
    DEVICE_CALL(dev, 1, REQUIRE(index) *index = (unsigned)g->index;);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t dev, unsigned int *isMigDevice)
{
    ANY_DEVICE_CALL(dev, 1, REQUIRE(isMigDevice) *isMigDevice = m != NULL;);
}

/* ------------------------------------------------------------------ identity */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length)
{
    ANY_DEVICE_CALL(dev, 0, {
        char mig_name[160];
        if (m) {   /* a MIG device is named after its board and profile: "NVIDIA H200 MIG 3g.71gb" */
            snprintf(mig_name, sizeof(mig_name), "%s MIG %s", g->name, m->profile_name);
            rc = copy_str(name, length, mig_name);
        } else {
            rc = copy_str(name, length, g->name);
        }
    });
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length)
{
    ANY_DEVICE_CALL(dev, 0, rc = copy_str(uuid, length, m ? m->uuid : g->uuid););
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t dev, unsigned int *minorNumber)
{
    DEVICE_CALL(dev, 0, REQUIRE(minorNumber) *minorNumber = g->minor;);
}

static void fill_pci(const sim_gpu *g, nvmlPciInfo_t *pci)
{
    memset(pci, 0, sizeof(*pci));
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = 0x147F10DEu;
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0",
             g->domain & 0xFFFFu, g->bus & 0xFFu, g->device & 0xFFu);
    snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.0", g->domain, g->bus & 0xFFu, g->device & 0xFFu);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci)
{
    DEVICE_CALL(dev, 0, REQUIRE(pci) fill_pci(g, pci););
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t dev, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(dev, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t dev, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(dev, pci); }

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t dev, int *major, int *minor)
{
    ANY_DEVICE_CALL(dev, 0, if (!major || !minor) rc = NVML_ERROR_INVALID_ARGUMENT; else { *major = g->cc_major; *minor = g->cc_minor; });
}

/* ------------------------------------------------------------------ memory */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *memory)
{
    ANY_DEVICE_CALL(dev, 0, REQUIRE(memory) {
        if (!MIG_AGGREGATE_ALLOWED(g, m)) {
            rc = NVML_ERROR_NO_PERMISSION;
        } else {
            double used = m ? mig_used_mib(g, m) : gpu_used_mib(g);
            memory->total = mib_to_bytes(m ? m->memory_mib : g->total_mib);
            memory->used = mib_to_bytes(used);
            memory->free = memory->total - memory->used;
        }
    });
}

#ifndef SIM_R470
static nvmlReturn_t memory_info_v2(nvmlDevice_t dev, nvmlMemory_v2_t *memory)
{
    ANY_DEVICE_CALL_IF(!g_state.r470, dev, 0,
        if (!memory)
            rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (memory->version != NVML_MEMORY_V2_VERSION)
            rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        else if (!MIG_AGGREGATE_ALLOWED(g, m))
            rc = NVML_ERROR_NO_PERMISSION;
        else {
            unsigned long long used = mib_to_bytes(m ? mig_used_mib(g, m) : gpu_used_mib(g));
            unsigned long long reserved = m ? 0 : mib_to_bytes(g->reserved_mib);
            memory->total = mib_to_bytes(m ? m->memory_mib : g->total_mib);
            memory->reserved = reserved < used ? reserved : used;
            memory->used = used - memory->reserved;
            memory->free = memory->total - used;
        });
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *memory) { return memory_info_v2(dev, memory); }
#endif

/* ------------------------------------------------------------------ metrics */

#define NA_OR(value, ...) if (isnan(value)) rc = NVML_ERROR_NOT_SUPPORTED; else { __VA_ARGS__ }

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *utilization)
{
    /* In MIG mode the driver reports no device utilization (nvidia-smi shows N/A); MIG handles neither. */
    DEVICE_CALL(dev, 0, REQUIRE(utilization) NA_OR(mig_active(g) ? NAN : g->util_pct,
        utilization->gpu = to_uint(gpu_util_pct(g));
        utilization->memory = to_uint(g->mem_util_pct);));
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, int sensorType, unsigned int *temp)
{
    DEVICE_CALL(dev, 0, REQUIRE(temp) {
        if (sensorType != 0)
            rc = NVML_ERROR_NOT_SUPPORTED;
        else
            NA_OR(g->temp_c, *temp = to_uint(g->temp_c););
    });
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t dev, nvmlTemperature_t *temperature)
{
    DEVICE_CALL(dev, 0, REQUIRE(temperature) {
        if (temperature->version != NVML_TEMPERATURE_V1_VERSION)
            rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        else if (temperature->sensorType != 0)
            rc = NVML_ERROR_NOT_SUPPORTED;
        else
            NA_OR(g->temp_c, temperature->temperature = (int)to_uint(g->temp_c););
    });
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t dev, unsigned int *power)
{
    DEVICE_CALL(dev, 0, REQUIRE(power) NA_OR(g->power_w, *power = to_uint(g->power_w * 1000.0);));
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t dev, unsigned int *limit)
{
    DEVICE_CALL(dev, 0, REQUIRE(limit) NA_OR(g->power_limit_w, *limit = to_uint(g->power_limit_w * 1000.0);));
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t dev, unsigned int *limit)
{
    return nvmlDeviceGetPowerManagementLimit(dev, limit);
}

nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t dev, unsigned int *speed)
{
    DEVICE_CALL(dev, 0, REQUIRE(speed) NA_OR(g->fan_pct, *speed = to_uint(g->fan_pct);));
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t dev, int *mode)
{
    DEVICE_CALL(dev, 0, REQUIRE(mode) *mode = g->persistence;);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *currentMode, unsigned int *pendingMode)
{
    DEVICE_CALL(dev, 0, if (!currentMode || !pendingMode) rc = NVML_ERROR_INVALID_ARGUMENT;
                else *currentMode = *pendingMode = (unsigned)g->mig;);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, int errorType, int counterType, unsigned long long *eccCounts)
{
    DEVICE_CALL(dev, 0, {
        if (!eccCounts || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
            rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *eccCounts = (unsigned long long)to_uint(errorType ? g->ecc_uncorrected : g->ecc_corrected);
    });
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    DEVICE_CALL(dev, 0, {
        if (!corrRows || !uncRows || !isPending || !failureOccurred) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *corrRows = to_uint(g->rr_correctable);
            *uncRows = to_uint(g->rr_uncorrectable);
            *isPending = (unsigned)g->rr_pending;
            *failureOccurred = (unsigned)g->rr_failure;
        }
    });
}

nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t dev, int *pState)
{
    DEVICE_CALL(dev, 0, REQUIRE(pState) *pState = 0;);    /* NVML_PSTATE_0 */
}

nvmlReturn_t nvmlDeviceGetDisplayActive(nvmlDevice_t dev, int *isActive)
{
    DEVICE_CALL(dev, 0, REQUIRE(isActive) *isActive = 0;);
}

nvmlReturn_t nvmlDeviceGetDisplayMode(nvmlDevice_t dev, int *display)
{
    DEVICE_CALL(dev, 0, REQUIRE(display) *display = 0;);
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t dev, int *mode)
{
    DEVICE_CALL(dev, 0, REQUIRE(mode) *mode = 0;);        /* NVML_COMPUTEMODE_DEFAULT */
}

static nvmlReturn_t codec_util(nvmlDevice_t dev, unsigned int *utilization, unsigned int *samplingPeriodUs)
{
    DEVICE_CALL(dev, 0, if (!utilization || !samplingPeriodUs) rc = NVML_ERROR_INVALID_ARGUMENT;
                else { *utilization = 0; *samplingPeriodUs = 167000; });
}

nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t dev, unsigned int *u, unsigned int *period)
{
    fault_point_named(__func__);
    return codec_util(dev, u, period);
}

nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t dev, unsigned int *u, unsigned int *period)
{
    fault_point_named(__func__);
    return codec_util(dev, u, period);
}

/* Stubs for things a Linux datacenter GPU in the simulator does not report. */
static nvmlReturn_t not_supported(nvmlDevice_t dev)
{
    DEVICE_CALL(dev, 0, rc = NVML_ERROR_NOT_SUPPORTED;);
}

#define NOT_SUPPORTED_STUB(name, params, ...) \
    nvmlReturn_t name params { __VA_ARGS__; fault_point_named(#name); return not_supported(dev); }

NOT_SUPPORTED_STUB(nvmlDeviceGetDriverModel_v2, (nvmlDevice_t dev, int *current, int *pending), (void)current, (void)pending)
NOT_SUPPORTED_STUB(nvmlDeviceGetDriverModel, (nvmlDevice_t dev, int *current, int *pending), (void)current, (void)pending)
NOT_SUPPORTED_STUB(nvmlDeviceGetClockInfo, (nvmlDevice_t dev, int type, unsigned int *clock), (void)type, (void)clock)
NOT_SUPPORTED_STUB(nvmlDeviceGetMaxClockInfo, (nvmlDevice_t dev, int type, unsigned int *clock), (void)type, (void)clock)
NOT_SUPPORTED_STUB(nvmlDeviceGetBAR1MemoryInfo, (nvmlDevice_t dev, void *bar1Memory), (void)bar1Memory)
NOT_SUPPORTED_STUB(nvmlDeviceGetPcieThroughput, (nvmlDevice_t dev, int counter, unsigned int *value), (void)counter, (void)value)
NOT_SUPPORTED_STUB(nvmlDeviceGetSerial, (nvmlDevice_t dev, char *serial, unsigned int length), (void)serial, (void)length)
/* ------------------------------------------------------------------ MIG devices */

/* GPUs without a MIG layout (mig off, or an older state's bare "mig": true) answer NOT_SUPPORTED, as before. */
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t dev, unsigned int *count)
{
    DEVICE_CALL(dev, 0, REQUIRE(count) {
        if (!mig_active(g)) rc = NVML_ERROR_NOT_SUPPORTED;
        else *count = SIM_MIG_COMPUTE_SLICES;
    });
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t dev, unsigned int index, nvmlDevice_t *migDevice)
{
    DEVICE_CALL(dev, 0, REQUIRE(migDevice) {
        unsigned k, n = 0;
        if (!mig_active(g)) rc = NVML_ERROR_NOT_SUPPORTED;
        for (k = 0, rc = rc ? rc : NVML_ERROR_NOT_FOUND; rc == NVML_ERROR_NOT_FOUND && k < g->nmig; k++)
            if (g->migs[k].has_ci && n++ == index) {   /* the MIG devices in GI order, GPU instances without CI skipped */
                *migDevice = &g_mig_handles[g - g_state.gpus][g->migs[k].gi];
                rc = NVML_SUCCESS;
            }
    });
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    ANY_DEVICE_CALL(migDevice, 0, REQUIRE(device) {
        if (!m) rc = NVML_ERROR_NOT_SUPPORTED;
        else *device = handle_for((unsigned)(g - g_state.gpus));
    });
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    ANY_DEVICE_CALL(dev, 0, REQUIRE(id) { if (!m) rc = NVML_ERROR_NOT_SUPPORTED; else *id = m->gi; });
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    ANY_DEVICE_CALL(dev, 0, REQUIRE(id) { if (!m) rc = NVML_ERROR_NOT_SUPPORTED; else *id = m->ci; });
}

/* ------------------------------------------------------------------ GPU and compute instances (read-only) */

/* The profile with this NVML_GPU_INSTANCE_PROFILE_* (by_enum) or profile id, or NULL. */
static const sim_profile *find_profile(const sim_gpu *g, unsigned value, int by_enum)
{
    unsigned i;
    for (i = 0; i < g->nprofiles; i++)
        if ((by_enum ? g->profiles[i].enum_id : g->profiles[i].id) == value)
            return &g->profiles[i];
    return NULL;
}

static const sim_profile *mig_profile(const sim_gpu *g, const sim_mig *m)
{
    return m->profile >= 0 ? &g->profiles[m->profile] : NULL;
}

static void fill_profile_info(const sim_profile *p, nvmlGpuInstanceProfileInfo_t *info)
{
    memset(info, 0, sizeof(*info));
    info->id = p->id;
    info->isP2pSupported = 0;
    info->sliceCount = p->slices;
    info->instanceCount = p->instance_count;
    info->multiprocessorCount = p->sm;
    info->copyEngineCount = p->ce;
    info->decoderCount = p->dec;
    info->encoderCount = p->enc;
    info->jpegCount = p->jpeg;
    info->ofaCount = p->ofa;
    info->memorySizeMB = (unsigned long long)(p->memory_mib > 0 ? p->memory_mib : 0);
}

/* Profiles answer only on a GPU with a MIG layout; a profile the board lacks is NOT_SUPPORTED. */
static nvmlReturn_t profile_lookup(const sim_gpu *g, unsigned int profile, const sim_profile **out)
{
    if (!mig_active(g))
        return NVML_ERROR_NOT_SUPPORTED;
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = find_profile(g, profile, 1);
    return *out ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t dev, unsigned int profile, nvmlGpuInstanceProfileInfo_t *info)
{
    DEVICE_CALL(dev, 0, REQUIRE(info) {
        const sim_profile *p = NULL;
        if ((rc = profile_lookup(g, profile, &p)) == NVML_SUCCESS)
            fill_profile_info(p, info);
    });
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t dev, unsigned int profile, nvmlGpuInstanceProfileInfo_v2_t *info)
{
    DEVICE_CALL(dev, 0, REQUIRE(info) {
        const sim_profile *p = NULL;
        nvmlGpuInstanceProfileInfo_t v1;
        if (info->version != NVML_GPU_INSTANCE_PROFILE_INFO_V2_VERSION) {
            rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        } else if ((rc = profile_lookup(g, profile, &p)) == NVML_SUCCESS) {
            fill_profile_info(p, &v1);
            info->id = v1.id;
            info->isP2pSupported = v1.isP2pSupported;
            info->sliceCount = v1.sliceCount;
            info->instanceCount = v1.instanceCount;
            info->multiprocessorCount = v1.multiprocessorCount;
            info->copyEngineCount = v1.copyEngineCount;
            info->decoderCount = v1.decoderCount;
            info->encoderCount = v1.encoderCount;
            info->jpegCount = v1.jpegCount;
            info->ofaCount = v1.ofaCount;
            info->memorySizeMB = v1.memorySizeMB;
            memset(info->name, 0, sizeof(info->name));
            snprintf(info->name, sizeof(info->name), "MIG %s", p->name);
        }
    });
}

/* Every placement of the profile (start:size in memory slices), taken or not, as the driver lists them. */
nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t dev, unsigned int profileId,
                                                           nvmlGpuInstancePlacement_t *placements, unsigned int *count)
{
    DEVICE_CALL(dev, 0, {
        const sim_profile *p = mig_active(g) ? find_profile(g, profileId, 0) : NULL;
        unsigned i;
        if (!count) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (!mig_active(g)) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else if (!p) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (!placements) {
            *count = p->nplacements;
        } else if (*count < p->nplacements) {
            *count = p->nplacements;
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            for (i = 0; i < p->nplacements; i++) {
                placements[i].start = p->placements[i];
                placements[i].size = p->memory_slices;
            }
            *count = p->nplacements;
        }
    });
}

/* How many more instances of the profile fit: free placements taken greedily, within the compute slices left
 * and the profile's most instances. */
nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t dev, unsigned int profileId, unsigned int *count)
{
    DEVICE_CALL(dev, 0, {
        const sim_profile *p = mig_active(g) ? find_profile(g, profileId, 0) : NULL;
        unsigned used_mem = 0, slices = 0, existing = 0, n = 0, i, k;
        if (!count) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (!mig_active(g)) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else if (!p) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            for (k = 0; k < g->nmig; k++) {
                const sim_profile *q = mig_profile(g, &g->migs[k]);
                unsigned span = q ? q->memory_slices : 1;
                if (g->migs[k].ci != 0) continue;   /* one per GPU instance */
                slices += q ? q->slices : 1;
                existing += q == p;
                for (i = 0; i < span && g->migs[k].placement + i < 32; i++) used_mem |= 1u << (g->migs[k].placement + i);
            }
            for (i = 0; i < p->nplacements; i++) {
                unsigned mask = ((1u << p->memory_slices) - 1u) << p->placements[i];
                if ((used_mem & mask) || slices + p->slices > SIM_MIG_COMPUTE_SLICES || existing + n >= p->instance_count)
                    continue;
                used_mem |= mask;
                slices += p->slices;
                n++;
            }
            *count = n;
        }
    });
}

static nvmlGpuInstance_t gi_handle(const sim_gpu *g, unsigned k)
{
    nvmlGpuInstance_t h = &g_gi_handles[g - g_state.gpus][g->migs[k].gi];
    h->slot = (unsigned)(g - g_state.gpus);
    h->mig = g->migs[k].gi;
    return h;
}

nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t dev, unsigned int profileId, nvmlGpuInstance_t *gpuInstances,
                                       unsigned int *count)
{
    DEVICE_CALL(dev, 0, {
        const sim_profile *p = mig_active(g) ? find_profile(g, profileId, 0) : NULL;
        unsigned k, n = 0;
        if (!count || !gpuInstances) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (!mig_active(g)) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else if (!p) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            for (k = 0; k < g->nmig; k++)
                if (g->migs[k].ci == 0 && mig_profile(g, &g->migs[k]) == p)
                    gpuInstances[n++] = gi_handle(g, k);
            *count = n;
        }
    });
}

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t dev, unsigned int id, nvmlGpuInstance_t *gpuInstance)
{
    DEVICE_CALL(dev, 0, {
        unsigned k;
        if (!gpuInstance) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (!mig_active(g)) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            rc = NVML_ERROR_NOT_FOUND;
            for (k = 0; rc == NVML_ERROR_NOT_FOUND && k < g->nmig; k++)
                if (g->migs[k].gi == id) {
                    *gpuInstance = gi_handle(g, k);
                    rc = NVML_SUCCESS;
                }
        }
    });
}

/* A GPU instance handle (or a compute instance's, same layout; `k` is the GI id) -> its GPU and MIG device. */
static nvmlReturn_t instance_lookup(unsigned slot, unsigned k, const sim_gpu **g, const sim_mig **m)
{
    if (slot >= g_state.ngpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    *g = &g_state.gpus[slot];
    if (!mig_active(*g) || mig_by_gi(*g, k) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *m = &(*g)->migs[mig_by_gi(*g, k)];
    return (*g)->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

static int gi_handle_valid(nvmlGpuInstance_t h)
{
    uintptr_t base = (uintptr_t)g_gi_handles, p = (uintptr_t)h;
    return h && p >= base && p < base + sizeof(g_gi_handles) && (p - base) % sizeof(g_gi_handles[0][0]) == 0;
}

static int ci_handle_valid(nvmlComputeInstance_t h)
{
    uintptr_t base = (uintptr_t)g_ci_handles, p = (uintptr_t)h;
    return h && p >= base && p < base + sizeof(g_ci_handles) && (p - base) % sizeof(g_ci_handles[0][0]) == 0;
}

#define INSTANCE_CALL(valid, handle, ...)                                               \
    const sim_gpu *g = NULL;                                                            \
    const sim_mig *m = NULL;                                                            \
    nvmlReturn_t rc = api_begin();                                                      \
    if (rc == NVML_SUCCESS)                                                             \
        rc = valid(handle) ? instance_lookup((handle)->slot, (handle)->mig, &g, &m)     \
                           : NVML_ERROR_INVALID_ARGUMENT;                               \
    if (rc == NVML_SUCCESS) { __VA_ARGS__ }                                             \
    return api_end(rc)

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    INSTANCE_CALL(gi_handle_valid, gpuInstance, REQUIRE(info) {
        const sim_profile *p = mig_profile(g, m);
        memset(info, 0, sizeof(*info));
        info->device = handle_for((unsigned)(g - g_state.gpus));
        info->id = m->gi;
        info->profileId = p ? p->id : 0;
        info->placement.start = m->placement;
        info->placement.size = p ? p->memory_slices : 1;
    });
}

static nvmlComputeInstance_t ci_handle(const sim_gpu *g, unsigned k)
{
    nvmlComputeInstance_t h = &g_ci_handles[g - g_state.gpus][g->migs[k].gi];
    h->slot = (unsigned)(g - g_state.gpus);
    h->mig = g->migs[k].gi;
    return h;
}

/* Each GPU instance holds one compute instance of its full size (gpusim creates them so, like `-cgi ... -C`). */
nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                nvmlComputeInstance_t *computeInstances, unsigned int *count)
{
    INSTANCE_CALL(gi_handle_valid, gpuInstance, {
        const sim_profile *p = mig_profile(g, m);
        if (!computeInstances || !count) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *count = 0;
            if (p && m->has_ci && p->ci_enum == profileId)
                computeInstances[(*count)++] = ci_handle(g, (unsigned)(m - g->migs));
        }
    });
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                   nvmlComputeInstance_t *computeInstance)
{
    INSTANCE_CALL(gi_handle_valid, gpuInstance, {
        if (!computeInstance) rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (!m->has_ci || m->ci != id) rc = NVML_ERROR_NOT_FOUND;
        else *computeInstance = ci_handle(g, (unsigned)(m - g->migs));
    });
}

nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info)
{
    INSTANCE_CALL(ci_handle_valid, computeInstance, REQUIRE(info) if (!m->has_ci) rc = NVML_ERROR_INVALID_ARGUMENT; else {
        const sim_profile *p = mig_profile(g, m);
        memset(info, 0, sizeof(*info));
        info->device = handle_for((unsigned)(g - g_state.gpus));
        info->gpuInstance = gi_handle(g, (unsigned)(m - g->migs));
        info->id = m->ci;
        info->profileId = p ? p->ci_enum : 0;
        info->placement.start = 0;
        info->placement.size = p ? p->slices : 1;
    });
}

/* ------------------------------------------------------------------ creating and destroying instances
 *
 * The shim never writes the state itself: it runs `python -E -s <sim>/gpusim _mig --state $GPU_SIM_STATE OP ...`
 * (gpusim_state.py is the one writer, under its lock), found next to this library (<sim>/build[/r470]; else the
 * `gpusim` on PATH), and reads
 * the new state back.  gpusim's exit status is the NVML return code; it prints the new instance's id.  Root only
 * (NO_PERMISSION otherwise), as the driver requires. */

static int gpusim_script(char *out, size_t size)
{
    Dl_info info;
    char lib[PATH_MAX], *slash;
    int up;
    if (!dladdr((void *)gpusim_script, &info) || !info.dli_fname || !realpath(info.dli_fname, lib))
        return -1;
    for (up = 0; up < 2; up++) {
        if (!(slash = strrchr(lib, '/'))) return -1;
        *slash = '\0';                                  /* <sim>/build/r470 -> <sim>/build -> <sim> */
        if ((size_t)snprintf(out, size, "%s/../gpusim", lib) < size && access(out, R_OK) == 0)
            return 0;
    }
    return -1;
}

/* Runs gpusim _mig with `args` (NULL-terminated); returns its NVML code, *id = the number it printed. */
static nvmlReturn_t run_gpusim_mig(const char *const *args, unsigned *id)
{
    char script[PATH_MAX], python[PATH_MAX], out[64];
    const char *argv[16], *state = getenv("GPU_SIM_STATE"), *base;
    int pipefd[2], status = 0, n = 0, i;
    ssize_t len, got = 0;
    pid_t pid;
    if (!state)
        return NVML_ERROR_UNKNOWN;
    if (gpusim_script(script, sizeof(script)) == 0) {
        len = readlink("/proc/self/exe", python, sizeof(python) - 1);
        python[len > 0 ? len : 0] = '\0';
        base = strrchr(python, '/') ? strrchr(python, '/') + 1 : python;
        argv[n++] = strncmp(base, "python", 6) == 0 ? python : "python3";   /* this interpreter, else PATH's */
        argv[n++] = "-E";
        argv[n++] = "-s";
        argv[n++] = script;
    } else {
        argv[n++] = "gpusim";   /* a library built outside the tree: the gpusim on PATH (`gpusim env` puts it there) */
    }
    argv[n++] = "_mig";
    argv[n++] = "--state";
    argv[n++] = state;
    for (i = 0; args[i] && n < 15; i++) argv[n++] = args[i];
    argv[n] = NULL;
    if (pipe(pipefd) != 0)
        return NVML_ERROR_UNKNOWN;
    pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDWR);
        dup2(pipefd[1], 1);
        if (devnull >= 0) { dup2(devnull, 0); dup2(devnull, 2); }
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(pipefd[1]);
    if (pid < 0) { close(pipefd[0]); return NVML_ERROR_UNKNOWN; }
    while (got < (ssize_t)sizeof(out) - 1 && (len = read(pipefd[0], out + got, sizeof(out) - 1 - got)) != 0) {
        if (len < 0 && errno == EINTR) continue;
        if (len < 0) break;
        got += len;
    }
    out[got] = '\0';
    close(pipefd[0]);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (!WIFEXITED(status) || WEXITSTATUS(status) == 127)
        return NVML_ERROR_UNKNOWN;
    if (id) *id = (unsigned)strtoul(out, NULL, 10);
    refresh();
    return WEXITSTATUS(status) == 0 ? NVML_SUCCESS : (nvmlReturn_t)WEXITSTATUS(status);
}

static nvmlReturn_t create_gi(nvmlDevice_t dev, unsigned int profileId, const nvmlGpuInstancePlacement_t *placement,
                              nvmlGpuInstance_t *gpuInstance)
{
    DEVICE_CALL(dev, 0, {
        char index[16], profile[16], start[16];
        const char *args[] = {"create-gi", index, profile, placement ? start : NULL, NULL};
        unsigned gi = 0;
        int k;
        snprintf(index, sizeof(index), "%d", g->index);
        snprintf(profile, sizeof(profile), "%u", profileId);
        snprintf(start, sizeof(start), "%u", placement ? placement->start : 0);
        if (!gpuInstance) rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (!mig_active(g)) rc = NVML_ERROR_NOT_SUPPORTED;
        else if (geteuid() != 0) rc = NVML_ERROR_NO_PERMISSION;
        else if (placement && (!find_profile(g, profileId, 0) || placement->size != find_profile(g, profileId, 0)->memory_slices))
            rc = NVML_ERROR_INVALID_ARGUMENT;
        else if ((rc = run_gpusim_mig(args, &gi)) == NVML_SUCCESS) {
            k = mig_by_gi(g, gi);   /* g points into g_state, read again in place */
            if (k < 0) rc = NVML_ERROR_UNKNOWN;
            else *gpuInstance = gi_handle(g, (unsigned)k);
        }
    });
}

nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t dev, unsigned int profileId, nvmlGpuInstance_t *gpuInstance)
{
    return create_gi(dev, profileId, NULL, gpuInstance);
}

nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t dev, unsigned int profileId,
                                                      const nvmlGpuInstancePlacement_t *placement, nvmlGpuInstance_t *gpuInstance)
{
    if (!placement) return NVML_ERROR_INVALID_ARGUMENT;
    return create_gi(dev, profileId, placement, gpuInstance);
}

/* Only the full-size compute instance of a GPU instance (its profile's ci_enum) is simulated. */
nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                  nvmlComputeInstance_t *computeInstance)
{
    INSTANCE_CALL(gi_handle_valid, gpuInstance, {
        char index[16], gi[16], profile[16];
        const char *args[] = {"create-ci", index, gi, profile, NULL};
        const sim_profile *p = mig_profile(g, m);
        unsigned ci = 0, gi_id = m->gi;
        snprintf(index, sizeof(index), "%d", g->index);
        snprintf(gi, sizeof(gi), "%u", m->gi);
        snprintf(profile, sizeof(profile), "%u", profileId);
        if (!computeInstance) rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (geteuid() != 0) rc = NVML_ERROR_NO_PERMISSION;
        else if (!p || p->ci_enum != profileId) rc = NVML_ERROR_NOT_SUPPORTED;
        else if (m->has_ci) rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
        else if ((rc = run_gpusim_mig(args, &ci)) == NVML_SUCCESS) {
            int k = mig_by_gi(g, gi_id);
            if (k < 0 || !g->migs[k].has_ci) rc = NVML_ERROR_UNKNOWN;
            else *computeInstance = ci_handle(g, (unsigned)k);
        }
    });
}

/* IN_USE while the compute instance exists (destroy it first), as the driver answers. */
nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
    INSTANCE_CALL(gi_handle_valid, gpuInstance, {
        char index[16], gi[16];
        const char *args[] = {"destroy-gi", index, gi, NULL};
        snprintf(index, sizeof(index), "%d", g->index);
        snprintf(gi, sizeof(gi), "%u", m->gi);
        if (geteuid() != 0) rc = NVML_ERROR_NO_PERMISSION;
        else if (m->has_ci) rc = NVML_ERROR_IN_USE;
        else rc = run_gpusim_mig(args, NULL);
    });
}

/* IN_USE while a listed process runs on it. */
nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
    INSTANCE_CALL(ci_handle_valid, computeInstance, {
        char index[16], gi[16];
        const char *args[] = {"destroy-ci", index, gi, NULL};
        size_t i;
        snprintf(index, sizeof(index), "%d", g->index);
        snprintf(gi, sizeof(gi), "%u", m->gi);
        if (!m->has_ci) rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (geteuid() != 0) rc = NVML_ERROR_NO_PERMISSION;
        for (i = 0; rc == NVML_SUCCESS && i < g_state.nprocs; i++)
            if (proc_on(&g_state.procs[i], g, m) && proc_listed(&g_state.procs[i])) rc = NVML_ERROR_IN_USE;
        if (rc == NVML_SUCCESS) rc = run_gpusim_mig(args, NULL);
    });
}

/* ------------------------------------------------------------------ processes */

/* Fills up to *count entries of the given layout (16 or 24 bytes) with the listed processes of
 * one type; the two-call size protocol of NVML. */
static nvmlReturn_t running_processes(nvmlDevice_t dev, int type, int v3, unsigned int *count, void *infos,
                                      size_t entry_size)
{
    /* A MIG device handle lists the processes on that instance; the board handle in MIG mode lists them all
     * (root only), each with its GPU and compute instance ids. */
    ANY_DEVICE_CALL_IF(!(v3 && g_state.r470), dev, 0, {
        size_t i;
        unsigned n = 0, want;
        if (g->no_permission || !MIG_AGGREGATE_ALLOWED(g, m)) {
            rc = NVML_ERROR_NO_PERMISSION;
        } else if (!count) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            for (i = 0; i < g_state.nprocs; i++)
                if (proc_on(&g_state.procs[i], g, m) && g_state.procs[i].type == type && proc_listed(&g_state.procs[i]))
                    n++;
            if (!infos || *count < n) {
                *count = n;
                rc = n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
            } else {
                want = n;
                n = 0;
                for (i = 0; i < g_state.nprocs && n < want; i++) {
                    const sim_proc *p = &g_state.procs[i];
                    unsigned long long mem;
                    if (!proc_on(p, g, m) || p->type != type || !proc_listed(p))
                        continue;
                    mem = isnan(p->used_mib) ? NVML_VALUE_NOT_AVAILABLE_ULL : mib_to_bytes(p->used_mib);
                    if (entry_size == sizeof(nvmlProcessInfo_v1_t)) {
                        nvmlProcessInfo_v1_t *e = (nvmlProcessInfo_v1_t *)infos + n;
                        memset(e, 0, sizeof(*e));
                        e->pid = p->pid;
                        e->usedGpuMemory = mem;
                    } else {
                        nvmlProcessInfo_v2_t *e = (nvmlProcessInfo_v2_t *)infos + n;
                        memset(e, 0, sizeof(*e));
                        e->pid = p->pid;
                        e->usedGpuMemory = mem;
                        e->gpuInstanceId = p->on_mig && mig_active(g) ? p->mig_gi : NVML_NO_INSTANCE;
                        e->computeInstanceId = p->on_mig && mig_active(g) ? p->mig_ci : NVML_NO_INSTANCE;
                    }
                    n++;
                }
                *count = n;
            }
        }
    });
}

#define PROCESS_LIST(name, type, v3, entry_t) \
    nvmlReturn_t name(nvmlDevice_t dev, unsigned int *infoCount, entry_t *infos) \
    { fault_point_named(#name); return running_processes(dev, type, v3, infoCount, infos, sizeof(entry_t)); }

PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, PT_COMPUTE, 0, nvmlProcessInfo_v1_t)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, PT_GRAPHICS, 0, nvmlProcessInfo_v1_t)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, PT_MPS, 0, nvmlProcessInfo_v1_t)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, PT_COMPUTE, 0, nvmlProcessInfo_v2_t)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, PT_GRAPHICS, 0, nvmlProcessInfo_v2_t)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, PT_MPS, 0, nvmlProcessInfo_v2_t)
#ifndef SIM_R470
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, PT_COMPUTE, 1, nvmlProcessInfo_v2_t)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, PT_GRAPHICS, 1, nvmlProcessInfo_v2_t)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, PT_MPS, 1, nvmlProcessInfo_v2_t)
#endif

/* One sample per listed process, stamped "now"; NOT_FOUND when none is newer than lastSeen. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t dev, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp)
{
    DEVICE_CALL(dev, 0, {
        unsigned long long stamp = (unsigned long long)(now_s() * 1e6);
        unsigned n = 0, want;
        size_t i;
        if (g->no_permission) {
            rc = NVML_ERROR_NO_PERMISSION;
        } else if (!processSamplesCount) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            for (i = 0; i < g_state.nprocs; i++)
                if (g_state.procs[i].gpu == g->index && proc_listed(&g_state.procs[i]))
                    n++;
            if (n == 0 || stamp <= lastSeenTimeStamp) {
                *processSamplesCount = 0;
                rc = NVML_ERROR_NOT_FOUND;
            } else if (!utilization || *processSamplesCount < n) {
                *processSamplesCount = n;
                rc = NVML_ERROR_INSUFFICIENT_SIZE;
            } else {
                want = n;
                n = 0;
                for (i = 0; i < g_state.nprocs && n < want; i++) {
                    const sim_proc *p = &g_state.procs[i];
                    nvmlProcessUtilizationSample_t *s = &utilization[n];
                    if (p->gpu != g->index || !proc_listed(p))
                        continue;
                    memset(s, 0, sizeof(*s));
                    s->pid = p->pid;
                    s->timeStamp = stamp;
                    s->smUtil = to_uint(p->util_pct);
                    s->memUtil = to_uint(p->mem_util_pct);
                    n++;
                }
                *processSamplesCount = n;
            }
        }
    });
}

/* ------------------------------------------------------------------ drain */

static nvmlReturn_t drain_lookup(const nvmlPciInfo_t *pci, const sim_gpu **out)
{
    char bus_id[33];
    int slot;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memcpy(bus_id, pci->busId, sizeof(pci->busId));
    bus_id[32] = '\0';
    if (bus_id[0] == '\0')
        snprintf(bus_id, sizeof(bus_id), "%08X:%02X:%02X.0", pci->domain, pci->bus & 0xFFu, pci->device & 0xFFu);
    if ((slot = slot_by_bus_id(bus_id)) < 0)
        return NVML_ERROR_NOT_FOUND;
    *out = &g_state.gpus[slot];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceQueryDrainState(nvmlPciInfo_t *pciInfo, int *currentState)
{
    const sim_gpu *g = NULL;
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS)
        rc = drain_lookup(pciInfo, &g);
    if (rc == NVML_SUCCESS) {
        REQUIRE(currentState) *currentState = g->drain;
    }
    return api_end(rc);
}

/* The state file is read-only for the shim: root gets NOT_SUPPORTED, others NO_PERMISSION. */
nvmlReturn_t nvmlDeviceModifyDrainState(nvmlPciInfo_t *pciInfo, int newState)
{
    const sim_gpu *g = NULL;
    nvmlReturn_t rc = api_begin();
    (void)newState;
    if (rc == NVML_SUCCESS)
        rc = drain_lookup(pciInfo, &g);
    if (rc == NVML_SUCCESS)
        rc = geteuid() == 0 ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_NO_PERMISSION;
    return api_end(rc);
}

/* ------------------------------------------------------------------ field values, events */

/* Only NVML_FI_DEV_GET_GPU_RECOVERY_ACTION is known (from the state's "recovery_action"; absent or null:
 * NOT_SUPPORTED); every other field id answers NOT_SUPPORTED in its own entry, as the driver does. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t dev, int valuesCount, nvmlFieldValue_t *values)
{
    DEVICE_CALL(dev, 0, {
        int i;
        if (valuesCount < 0 || (valuesCount > 0 && !values)) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            for (i = 0; i < valuesCount; i++) {
                values[i].timestamp = (long long)(now_s() * 1e6);
                values[i].latencyUsec = 0;
                if (values[i].fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && !isnan(g->recovery_action)) {
                    values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
                    values[i].value.ullVal = 0;
                    values[i].value.uiVal = to_uint(g->recovery_action);
                    values[i].nvmlReturn = NVML_SUCCESS;
                } else {
                    values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
                }
            }
        }
    });
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t dev, unsigned long long *reasons)
{
    DEVICE_CALL(dev, 0, REQUIRE(reasons) *reasons = (unsigned long long)to_uint(g->clocks_event_reasons););
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t dev, unsigned long long *reasons)
{
    fault_point_named(__func__);
    return nvmlDeviceGetCurrentClocksEventReasons(dev, reasons);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t dev, unsigned long long *eventTypes)
{
    DEVICE_CALL(dev, 0, REQUIRE(eventTypes) *eventTypes = EVENT_SBE | EVENT_DBE | EVENT_XID;);
}

/* An event set: per GPU slot, the registered types and the highest event seq it has seen.  Like the
 * driver, a set receives only the events that occur after it registered (seq above the queue's highest
 * at registration). */
struct nvmlEventSet_st {
    unsigned long long types[SIM_MAX_GPUS];
    double seen[SIM_MAX_GPUS];
};

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS) {
        REQUIRE(set) {
            *set = calloc(1, sizeof(**set));
            if (!*set) rc = NVML_ERROR_UNKNOWN;
        }
    }
    return api_end(rc);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long eventTypes, nvmlEventSet_t set)
{
    DEVICE_CALL(dev, 0, {
        unsigned slot = (unsigned)(g - g_state.gpus), i;
        double top = 0;
        if (!set) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (eventTypes & ~(EVENT_SBE | EVENT_DBE | EVENT_XID)) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            for (i = 0; i < g->nevents; i++)
                if (g->event_seq[i] > top) top = g->event_seq[i];
            if (!set->types[slot]) set->seen[slot] = top;
            set->types[slot] |= eventTypes;
        }
    });
}

/* The next event (lowest seq above what the set saw) on any registered GPU; 1 when one was found. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data)
{
    unsigned slot, i;
    for (slot = 0; slot < g_state.ngpus && slot < SIM_MAX_GPUS; slot++) {
        const sim_gpu *g = &g_state.gpus[slot];
        int best = -1;
        if (!(set->types[slot] & EVENT_XID) || g->lost)
            continue;
        for (i = 0; i < g->nevents; i++)
            if (g->event_seq[i] > set->seen[slot] && (best < 0 || g->event_seq[i] < g->event_seq[best]))
                best = (int)i;
        if (best >= 0) {
            set->seen[slot] = g->event_seq[best];
            data->device = handle_for(slot);
            data->eventType = EVENT_XID;
            data->eventData = g->event_code[best];
            data->gpuInstanceId = data->computeInstanceId = NVML_NO_INSTANCE;
            return 1;
        }
    }
    return 0;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    double deadline = now_s() + timeoutms / 1000.0;
    for (;;) {
        nvmlReturn_t rc = api_begin();
        if (rc == NVML_SUCCESS && (!set || !data))
            rc = NVML_ERROR_INVALID_ARGUMENT;
        if (rc == NVML_SUCCESS && !next_event(set, data))
            rc = NVML_ERROR_TIMEOUT;
        api_end(rc);
        if (rc != NVML_ERROR_TIMEOUT || now_s() >= deadline)
            return rc;
        sleep_until(now_s() + 0.01 < deadline ? now_s() + 0.01 : deadline);
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t rc = api_begin();
    if (rc == NVML_SUCCESS) {
        REQUIRE(set) free(set);
    }
    return api_end(rc);
}
