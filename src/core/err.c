#include "core/err.h"

#include <stdarg.h>
#include <stdio.h>

int kvr_err_set(struct kvr_err *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        err->code = code;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

const char *kvr_strerror(int code)
{
    static const char *const names[KVR_STATUS_COUNT] = {
        "ok",
        "invalid argument",
        "out of memory",
        "i/o error",
        "bad format",
        "out of range",
        "not supported",
        "protocol error",
        "authentication failed",
        "connection closed",
        "timed out",
        "try again",
        "full",
        "not found",
    };
    int i = -code;
    return (i >= 0 && i < KVR_STATUS_COUNT) ? names[i] : "unknown error";
}
