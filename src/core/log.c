#include "core/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_tag[32] = "kvasir";
/* Atomic because one thread may set the level while others log. */
static atomic_int log_level = KVR_LOG_INFO;

enum kvr_log_level kvr_log_level_from_name(const char *name)
{
    if (!name)
        return KVR_LOG_INFO;
    if (!strcmp(name, "error"))
        return KVR_LOG_ERROR;
    if (!strcmp(name, "warn"))
        return KVR_LOG_WARN;
    if (!strcmp(name, "debug"))
        return KVR_LOG_DEBUG;
    return KVR_LOG_INFO;
}

void kvr_log_set_tag(const char *tag)
{
    pthread_mutex_lock(&log_lock);
    snprintf(log_tag, sizeof log_tag, "%s", tag);
    pthread_mutex_unlock(&log_lock);
}

void kvr_log_set_level(enum kvr_log_level level)
{
    atomic_store_explicit(&log_level, (int)level, memory_order_relaxed);
}

int kvr_log_enabled(enum kvr_log_level level)
{
    return (int)level <= atomic_load_explicit(&log_level, memory_order_relaxed);
}

int kvr_log_stamp(char *out, long long unix_ms)
{
    time_t s = (time_t)(unix_ms / 1000);
    struct tm tm;
    gmtime_r(&s, &tm);
    return snprintf(out, KVR_LOG_STAMP_BYTES, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ",
                    tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                    (int)(unix_ms % 1000));
}

void kvr_log(enum kvr_log_level level, const char *fmt, ...)
{
    static const char *const names[KVR_LOG_LEVEL_COUNT] = {"error", "warn", "info", "debug"};
    if (!kvr_log_enabled(level))
        return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    char stamp[KVR_LOG_STAMP_BYTES];
    kvr_log_stamp(stamp, (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
    pthread_mutex_lock(&log_lock);
    fprintf(stderr, "[%s %s %s] %s\n", stamp, log_tag, names[level], line);
    pthread_mutex_unlock(&log_lock);
}
