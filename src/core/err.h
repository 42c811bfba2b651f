/* err.h - status codes and the optional error struct that parsers and loaders fill.
 *
 * Every fallible function returns 0 (KVR_OK) or a negative enum kvr_status. Functions
 * that parse untrusted input also take an optional `struct kvr_err *` (may be NULL) and
 * write a precise, human-readable message into it. Pure module: no I/O, no globals. */
#ifndef KVR_CORE_ERR_H
#define KVR_CORE_ERR_H

enum kvr_status {
    KVR_OK = 0,
    KVR_EINVAL = -1,  /* bad argument or bad input value */
    KVR_ENOMEM = -2,  /* allocation failed or a size overflowed */
    KVR_EIO = -3,     /* an OS call failed */
    KVR_EFORMAT = -4, /* malformed file or message */
    KVR_ERANGE = -5,  /* a count or size outside its allowed bounds */
    KVR_ENOTSUP = -6, /* valid but not supported by this build */
    KVR_EPROTO = -7,  /* peer broke the wire protocol */
    KVR_EAUTH = -8,   /* authentication failed */
    KVR_ECLOSED = -9, /* the other side closed the connection */
    KVR_ETIMEDOUT = -10,
    KVR_EAGAIN = -11, /* try again later (would block) */
    KVR_EFULL = -12,  /* a fixed-capacity structure is full */
    KVR_ENOTFOUND = -13,
    KVR_STATUS_COUNT = 14
};

#define KVR_ERR_MSG_BYTES 256

struct kvr_err {
    int code;                    /* enum kvr_status of the first failure recorded */
    char msg[KVR_ERR_MSG_BYTES]; /* NUL-terminated message */
};

/* Record `code` and a printf-style message in `err` (if non-NULL) and return `code`, so a
 * failure is reported in one line: `return kvr_err_set(err, KVR_EFORMAT, "...", ...);`. */
int kvr_err_set(struct kvr_err *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Short static name of a status code ("invalid argument", ...). */
const char *kvr_strerror(int code);

#endif
