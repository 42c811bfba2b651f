#include "core/log.h"

#include "core/clock.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

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
    double t_s = (double)kvr_now_ns() / 1e9;
    pthread_mutex_lock(&log_lock);
    fprintf(stderr, "[%10.3f %s %s] %s\n", t_s, log_tag, names[level], line);
    pthread_mutex_unlock(&log_lock);
}
