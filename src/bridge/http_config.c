/* http_config.c - the HTTP server's defaults and the command-line options that set its door,
 * CORS and metrics (see http.h), so that `kvasir serve` and `kvasir bridge` share one
 * spelling and one help text. */
#include "bridge/http.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

void kvr_http_config_init(struct kvr_http_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->host = "127.0.0.1";
    cfg->port = 8080;
    cfg->api_key = getenv("KVASIR_API_KEY");
    cfg->max_body_bytes = 1u << 20;
    /* Each connection has a thread (http.h): 512 with small stacks is ~40 MiB of touched
     * memory at most, and far more clients than a CPU ring can serve at once. */
    cfg->max_connections = 512;
    cfg->max_per_client = 64;
    cfg->header_timeout_s = 10;
    cfg->body_timeout_s = 30;
    cfg->idle_timeout_s = 60;
    cfg->stall_timeout_s = 300;
    cfg->cors_origin = "*"; /* the local demo's web pages may call it */
}

const char kvr_http_config_help[] =
    "  --max-connections N   connections held at once (default 512); 1/8 of them are\n"
    "                        kept for requests whose headers have arrived\n"
    "  --max-per-client N    connections from one client address (default 64; 0 = any)\n"
    "  --header-timeout S    close a connection that has not sent its request headers\n"
    "                        S seconds after connecting (default 10)\n"
    "  --body-timeout S      ... or its body S seconds after the headers (default 30)\n"
    "  --idle-timeout S      close a keep-alive connection idle for S seconds (default 60)\n"
    "  --cors-origin ORIGIN  Access-Control-Allow-Origin of every answer, preflights\n"
    "                        answered (default '*'; 'none' = no CORS)\n"
    "  --metrics-public      serve /metrics without the API key\n";

static const struct {
    const char *name;
    size_t field; /* offsetof the uint32_t it sets */
    uint32_t lo, hi;
} numeric[] = {
    {"--max-connections", offsetof(struct kvr_http_config, max_connections), 1, 100000},
    {"--max-per-client", offsetof(struct kvr_http_config, max_per_client), 0, 100000},
    {"--header-timeout", offsetof(struct kvr_http_config, header_timeout_s), 1, 3600},
    {"--body-timeout", offsetof(struct kvr_http_config, body_timeout_s), 1, 3600},
    {"--idle-timeout", offsetof(struct kvr_http_config, idle_timeout_s), 1, 86400},
};

int kvr_http_config_arg(struct kvr_http_config *cfg, int argc, char **argv, struct kvr_err *err)
{
    if (argc < 1)
        return 0;
    const char *a = argv[0], *v = argc > 1 ? argv[1] : NULL;
    if (!strcmp(a, "--metrics-public")) {
        cfg->metrics_public = true;
        return 1;
    }
    bool cors = !strcmp(a, "--cors-origin");
    size_t k = 0;
    while (k < sizeof numeric / sizeof numeric[0] && strcmp(a, numeric[k].name))
        k++;
    if (!cors && k == sizeof numeric / sizeof numeric[0])
        return 0;
    if (!v)
        return kvr_err_set(err, KVR_EINVAL, "%s needs a value", a);
    if (cors) {
        cfg->cors_origin = v;
        return 2;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-' || n < numeric[k].lo || n > numeric[k].hi)
        return kvr_err_set(err, KVR_EINVAL, "%s wants a whole number in [%u, %u], not '%s'", a,
                           numeric[k].lo, numeric[k].hi, v);
    *(uint32_t *)(void *)((char *)cfg + numeric[k].field) = (uint32_t)n;
    return 2;
}
