/* log.h - leveled logging to stderr, one line per call, with a wall-clock timestamp (ISO 8601
 * in UTC with milliseconds, so lines of processes on different machines line up with each
 * other and with other programs' logs) and the process's role tag (set once at start-up,
 * e.g. "stage1"). Thread-safe. Durations are measured with core/clock.h's monotonic clock,
 * never from these stamps. The level is info
 * until kvr_log_set_level changes it; the program reads it from the KVR_LOG environment
 * variable once, at the start of main (cli/main.c), so this module reads no environment. */
#ifndef KVR_CORE_LOG_H
#define KVR_CORE_LOG_H

enum kvr_log_level {
    KVR_LOG_ERROR,
    KVR_LOG_WARN,
    KVR_LOG_INFO,
    KVR_LOG_DEBUG,
    KVR_LOG_LEVEL_COUNT
};

void kvr_log_set_tag(const char *tag);
void kvr_log_set_level(enum kvr_log_level level);
/* The level a name stands for: "error", "warn", "info", "debug"; info for NULL or any
 * other name. */
enum kvr_log_level kvr_log_level_from_name(const char *name);
int kvr_log_enabled(enum kvr_log_level level);
/* Write the stamp of `unix_ms` (milliseconds since 1970 UTC), "2026-12-07T20:45:01.123Z",
 * to out (at least KVR_LOG_STAMP_BYTES); returns its length. */
#define KVR_LOG_STAMP_BYTES 32
int kvr_log_stamp(char *out, long long unix_ms);
void kvr_log(enum kvr_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define KVR_ERROR(...) kvr_log(KVR_LOG_ERROR, __VA_ARGS__)
#define KVR_WARN(...) kvr_log(KVR_LOG_WARN, __VA_ARGS__)
#define KVR_INFO(...) kvr_log(KVR_LOG_INFO, __VA_ARGS__)
#define KVR_DEBUG(...)                                                                             \
    do {                                                                                           \
        if (kvr_log_enabled(KVR_LOG_DEBUG))                                                        \
            kvr_log(KVR_LOG_DEBUG, __VA_ARGS__);                                                   \
    } while (0)

#endif
