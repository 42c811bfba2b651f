/* console.c - look up the embedded console assets (console.h). The table itself is
 * generated at build time from web/console/ (cmake/embed_console.cmake). */
#include "bridge/console.h"

#include <string.h>

/* One header value. 'self' is the origin that served the page: the bridge. Everything not
 * named falls back to 'none'; no inline script or style is allowed anywhere (the page sets
 * styles only through the CSSOM, which CSP does not restrict). */
const char kvr_console_csp[] =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'";

static const struct {
    const char *ext;
    const char *type;
} types[] = {
    {".html", "text/html; charset=utf-8"},
    {".js", "text/javascript; charset=utf-8"},
    {".css", "text/css; charset=utf-8"},
    {".svg", "image/svg+xml"},
    {".json", "application/json"},
    {".txt", "text/plain; charset=utf-8"},
    {".png", "image/png"},
    {".ico", "image/x-icon"},
};

const char *kvr_console_content_type(const char *path)
{
    size_t n = strlen(path);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        size_t e = strlen(types[i].ext);
        if (n >= e && strcmp(path + n - e, types[i].ext) == 0)
            return types[i].type;
    }
    return "application/octet-stream";
}

int kvr_console_asset(const char *path, const void **data, size_t *len, const char **content_type)
{
    if (!path)
        return -1;
    if (strcmp(path, "/") == 0)
        path = "/index.html";
    /* The table is small (a handful of files): a linear scan is clearer than a search. */
    for (size_t i = 0; i < kvr_console_n_files; i++) {
        if (strcmp(kvr_console_files[i].path, path) == 0) {
            *data = kvr_console_files[i].data;
            *len = kvr_console_files[i].len;
            *content_type = kvr_console_content_type(path);
            return 0;
        }
    }
    return -1;
}
