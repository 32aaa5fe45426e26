# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpusim fake of amdsmi.amdsmi_exception: the same classes, attributes and messages as amdsmi 7.0.2."""

from . import amdsmi_wrapper

_MESSAGES = {
    'INVAL': 'Invalid parameters',
    'NOT_SUPPORTED': 'Feature not supported',
    'NOT_YET_IMPLEMENTED': 'Feature not yet implemented',
    'FAIL_LOAD_MODULE': 'Fail to load lib',
    'FAIL_LOAD_SYMBOL': 'Fail to load symbol',
    'DRM_ERROR': 'Error when called libdrm',
    'API_FAILED': 'API call failed',
    'TIMEOUT': 'Timeout in API call',
    'RETRY': 'Retry operation',
    'NO_PERM': 'Permission Denied',
    'INTERRUPT': 'Interrupt ocurred during execution',
    'IO': 'I/O Error',
    'ADDRESS_FAULT': 'Bad address',
    'FILE_ERROR': 'Error opening file',
    'OUT_OF_RESOURCES': 'Not enough memory',
    'INTERNAL_EXCEPTION': ' Internal error',
    'INPUT_OUT_OF_BOUNDS': 'Out of bounds',
    'INIT_ERROR': 'Initialization error',
    'REFCOUNT_OVERFLOW': 'Internal reference counter exceeded INT32_MAX',
    'DIRECTORY_NOT_FOUND': 'Error when a directory is not found, maps to ENOTDIR',
    'BUSY': 'Device busy',
    'NOT_FOUND': 'Device Not found',
    'NOT_INIT': 'Device not initialized',
    'NO_SLOT': 'No more free slot',
    'DRIVER_NOT_LOADED': 'Driver not loaded',
    'NO_DATA': 'No data was found for given input',
    'INSUFFICIENT_SIZE': 'Insufficient size for operation',
    'UNEXPECTED_SIZE': 'unexpected size of data was read',
    'UNEXPECTED_DATA': 'The data read or provided was unexpected',
    'FILE_NOT_FOUND': 'File or directory not found',
    'ARG_PTR_NULL': 'Parsed argument is invalid',
    'MAP_ERROR': 'The internal library error did not map to a status code',
    'AMDGPU_RESTART_ERR': 'AMDGPU restart failed, please check dmsg for errors',
    'SETTING_UNAVAILABLE': 'Setting is not available',
    'CORRUPTED_EEPROM': 'Setting is not available',
}
_ERR_INFO = dict(
    (getattr(amdsmi_wrapper, 'AMDSMI_STATUS_' + name), 'AMDSMI_STATUS_%s - %s' % (name, text))
    for name, text in _MESSAGES.items()
)
_UNKNOWN = 'AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred'


class AmdSmiException(Exception):
    """Base smi exception class"""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code):
        err_code = abs(err_code)
        super(AmdSmiLibraryException, self).__init__(err_code)
        self.err_code = err_code
        self.set_err_info()

    def __str__(self):
        return "Error code:\n\t{err_code} | {err_info}".format(err_code=self.err_code, err_info=self.err_info)

    def get_error_info(self, detailed=True):
        if detailed:
            return self.err_info
        return str(self.err_info).split(" - ", maxsplit=1)[0]

    def get_error_code(self):
        return self.err_code

    def set_err_info(self):
        self.err_info = _ERR_INFO.get(self.err_code, _UNKNOWN)


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self):
        super(AmdSmiRetryException, self).__init__(amdsmi_wrapper.AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self):
        super(AmdSmiTimeoutException, self).__init__(amdsmi_wrapper.AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, receivedValue, expectedType, msg=None):  # pylint: disable=invalid-name
        super(AmdSmiParameterException, self).__init__(msg)
        self.err_code = None
        self.actualType = type(receivedValue)  # pylint: disable=invalid-name
        self.expectedType = expectedType  # pylint: disable=invalid-name
        self.set_err_msg()
        if msg is not None:
            self.err_msg = msg

    def set_err_msg(self):
        self.err_msg = ("Invalid parameter:\n" + "Actual type: {0}\n".format(self.actualType)
                        + "Expected type: {0}".format(self.expectedType))

    def __str__(self):
        return self.err_msg


class AmdSmiKeyException(AmdSmiException):
    def __init__(self, key):
        super(AmdSmiKeyException, self).__init__()
        self.key = key
        self.set_err_msg()

    def set_err_msg(self):
        self.err_msg = "Key " + self.key + " is missing from dictionary"

    def __str__(self):
        return self.err_msg


class AmdSmiBdfFormatException(AmdSmiException):
    def __init__(self, bdf):
        super(AmdSmiBdfFormatException, self).__init__()
        self.bdf = bdf

    def __str__(self):
        return ("Wrong BDF format: {0}. \nBDF string should be: <domain>:<bus>:<device>.<function>\n"
                " or <bus>:<device>.<function> in hexcode format.").format(self.bdf)
