/* plan.c - parse, validate, hash and write the deployment plan; split layers over stages.
 *
 * The JSON format is documented with an example in docs/PLAN.md. Parsing (jansson) only
 * checks each key on its own; kvr_plan_validate applies the rules that tie keys together,
 * so a plan built in code (the planner, tests) goes through the same rules as a file. */
#define _POSIX_C_SOURCE 200809L /* strnlen, fileno, fsync, fdopen, O_CLOEXEC */
#include "ring/plan.h"

#include "core/alloc.h"
#include "core/log.h"
#include "ring/addr.h"
#include "ring/plan_int.h"
#include "ring/wire.h"
#include "model/kv.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PLAN_FILE_MAX_BYTES (1u << 20)
#define SECRET_FILE_MAX_BYTES 4096

/* ---- Small helpers --------------------------------------------------------------------- */

static int hex_digit(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Decode exactly len hex digits (len even) into out (cap bytes). Returns bytes or -1. */
static long hex_decode(const char *s, size_t len, uint8_t *out, size_t cap)
{
    if (len % 2 != 0 || len / 2 > cap)
        return -1;
    for (size_t i = 0; i < len; i += 2) {
        int hi = hex_digit((unsigned char)s[i]), lo = hex_digit((unsigned char)s[i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        out[i / 2] = (uint8_t)(hi << 4 | lo);
    }
    return (long)(len / 2);
}

static int copy_str(char *dst, size_t cap, const char *src, const char *what, struct kvr_err *err)
{
    size_t n = strlen(src);
    if (n >= cap)
        return kvr_err_set(err, KVR_ERANGE, "%s is %zu bytes long; the limit is %zu", what, n,
                           cap - 1);
    memcpy(dst, src, n + 1);
    return KVR_OK;
}

int kvr_plan_kv_type_parse(const char *s, enum kvr_dtype *out)
{
    int t = kvr_dtype_by_name(s);
    if (t < 0 || !kvr_kv_type_ok((enum kvr_dtype)t))
        return KVR_EINVAL;
    *out = (enum kvr_dtype)t;
    return KVR_OK;
}

const char *kvr_plan_kv_type_name(enum kvr_dtype t)
{
    return kvr_kv_type_ok(t) ? kvr_dtype_traits(t)->name : NULL;
}

/* The name of a type hidden states may travel in between stages, or NULL. */
static const char *dtype_name(enum kvr_dtype t)
{
    return kvr_wire_payload_of_dtype(t) != KVR_WIRE_PAYLOAD_COUNT ? kvr_dtype_traits(t)->name
                                                                  : NULL;
}

/* ---- Parsing --------------------------------------------------------------------------- */

/* A non-negative JSON integer that fits 32 bits. */
static int get_u32(json_t *v, const char *what, uint32_t *out, struct kvr_err *err)
{
    if (!json_is_integer(v))
        return kvr_err_set(err, KVR_EINVAL, "plan: %s must be an integer", what);
    json_int_t x = json_integer_value(v);
    if (x < 0 || (unsigned long long)x > UINT32_MAX)
        return kvr_err_set(err, KVR_ERANGE, "plan: %s is %lld; it must be between 0 and %u", what,
                           (long long)x, UINT32_MAX);
    *out = (uint32_t)x;
    return KVR_OK;
}

static int get_str(json_t *v, const char *what, char *dst, size_t cap, struct kvr_err *err)
{
    if (!json_is_string(v))
        return kvr_err_set(err, KVR_EINVAL, "plan: %s must be a string", what);
    char label[64];
    snprintf(label, sizeof label, "plan: %s", what);
    return copy_str(dst, cap, json_string_value(v), label, err);
}

static int check_keys(json_t *obj, const char *const *allowed, const char *where,
                      struct kvr_err *err)
{
    const char *key;
    json_t *v;
    json_object_foreach(obj, key, v)
    {
        bool ok = false;
        for (const char *const *a = allowed; *a && !ok; a++)
            ok = !strcmp(key, *a);
        if (!ok)
            return kvr_err_set(err, KVR_EINVAL, "plan: unknown key \"%s\" in %s", key, where);
    }
    return KVR_OK;
}

int kvr_plan_json_u32(json_t *v, const char *what, uint32_t *out, struct kvr_err *err)
{
    return get_u32(v, what, out, err);
}
int kvr_plan_json_str(json_t *v, const char *what, char *dst, size_t cap, struct kvr_err *err)
{
    return get_str(v, what, dst, cap, err);
}
int kvr_plan_json_keys(json_t *obj, const char *const *allowed, const char *where,
                       struct kvr_err *err)
{
    return check_keys(obj, allowed, where, err);
}

static int parse_fingerprint(json_t *v, uint64_t *out, struct kvr_err *err)
{
    if (!json_is_string(v))
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: model_fingerprint must be a hex string (\"0x1234abcd...\")");
    const char *s = json_string_value(v);
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        s += 2;
    size_t n = strlen(s);
    if (n == 0 || n > 16)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: model_fingerprint \"%s\" must be 1 to 16 hex digits",
                           json_string_value(v));
    uint64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        int d = hex_digit((unsigned char)s[i]);
        if (d < 0)
            return kvr_err_set(err, KVR_EINVAL, "plan: model_fingerprint \"%s\" is not hexadecimal",
                               json_string_value(v));
        x = x << 4 | (uint64_t)d;
    }
    *out = x;
    return KVR_OK;
}

static int parse_stage(json_t *v, uint32_t i, struct kvr_plan_stage *st, struct kvr_err *err)
{
    static const char *const keys[] = {"addr", "layers", "threads", NULL};
    char where[48];
    snprintf(where, sizeof where, "stages[%u]", i);
    if (!json_is_object(v))
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: %s must be an object {\"addr\": ..., \"layers\": [a, b]}", where);
    int rc = check_keys(v, keys, where, err);
    if (rc)
        return rc;
    char what[64];
    json_t *addr = json_object_get(v, "addr");
    if (!addr)
        return kvr_err_set(err, KVR_EINVAL, "plan: %s has no \"addr\"", where);
    snprintf(what, sizeof what, "%s.addr", where);
    if ((rc = get_str(addr, what, st->addr, sizeof st->addr, err)))
        return rc;
    json_t *layers = json_object_get(v, "layers");
    if (!json_is_array(layers) || json_array_size(layers) != 2)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: %s.layers must be [first, last] (an inclusive range)", where);
    snprintf(what, sizeof what, "%s.layers[0]", where);
    if ((rc = get_u32(json_array_get(layers, 0), what, &st->first_layer, err)))
        return rc;
    snprintf(what, sizeof what, "%s.layers[1]", where);
    if ((rc = get_u32(json_array_get(layers, 1), what, &st->last_layer, err)))
        return rc;
    json_t *threads = json_object_get(v, "threads");
    snprintf(what, sizeof what, "%s.threads", where);
    if (threads && (rc = get_u32(threads, what, &st->n_threads, err)))
        return rc;
    return KVR_OK;
}

/* Where the ring is: the model file, its stages and the bridge. */
static int parse_places(struct kvr_plan *p, json_t *root, struct kvr_err *err)
{
    int rc;
    json_t *v = json_object_get(root, "model");
    if (!v)
        return kvr_err_set(err, KVR_EINVAL, "plan: \"model\" (the GGUF file's path) is missing");
    if ((rc = get_str(v, "model", p->model_path, sizeof p->model_path, err)))
        return rc;
    if ((v = json_object_get(root, "model_fingerprint")) &&
        (rc = parse_fingerprint(v, &p->model_fingerprint, err)))
        return rc;

    json_t *stages = json_object_get(root, "stages");
    if (!json_is_array(stages))
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: \"stages\" must be an array of {\"addr\", \"layers\"}");
    size_t n = json_array_size(stages);
    if (n > KVR_PLAN_MAX_STAGES)
        return kvr_err_set(err, KVR_ERANGE, "plan: %zu stages; at most %d are supported", n,
                           KVR_PLAN_MAX_STAGES);
    p->n_stages = (uint32_t)n;
    for (uint32_t i = 0; i < p->n_stages; i++)
        if ((rc = parse_stage(json_array_get(stages, i), i, &p->stages[i], err)))
            return rc;

    v = json_object_get(root, "bridge");
    if (!v)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: \"bridge\" (the address the bridge listens on) is missing");
    if ((rc = get_str(v, "bridge", p->bridge_addr, sizeof p->bridge_addr, err)))
        return rc;
    return KVR_OK;
}

/* The sizes: row width, microbatches, sequence slots, context, KV blocks, threads. */
static int parse_sizes(struct kvr_plan *p, json_t *root, struct kvr_err *err)
{
    int rc;
    json_t *v;
    struct {
        const char *key;
        uint32_t *dst;
        bool required;
    } ints[] = {
        {"row_width", &p->row_width, true},
        {"microbatches", &p->microbatches, true},
        {"max_seqs", &p->max_seqs, true},
        {"n_ctx", &p->n_ctx, true},
        {"kv_block_tokens", &p->kv_block_tokens, false},
        {"kv_blocks", &p->kv_blocks, false},
        {"threads", &p->n_threads, false},
    };
    bool have_kv_blocks = false;
    p->kv_block_tokens = KVR_PLAN_DEFAULT_KV_BLOCK_TOKENS;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        v = json_object_get(root, ints[i].key);
        if (!v) {
            if (ints[i].required)
                return kvr_err_set(err, KVR_EINVAL, "plan: \"%s\" is missing", ints[i].key);
            continue;
        }
        if ((rc = get_u32(v, ints[i].key, ints[i].dst, err)))
            return rc;
        if (ints[i].dst == &p->kv_blocks)
            have_kv_blocks = true;
    }
    /* Default KV: enough blocks for every slot to hold a full context. Computed in 64 bits
     * and clamped so an absurd product is reported by validate, not wrapped here. */
    if (!have_kv_blocks && p->kv_block_tokens > 0) {
        uint64_t per_seq = ((uint64_t)p->n_ctx + p->kv_block_tokens - 1) / p->kv_block_tokens;
        uint64_t blocks = per_seq * p->max_seqs;
        p->kv_blocks = blocks > UINT32_MAX ? UINT32_MAX : (uint32_t)blocks;
    }
    return KVR_OK;
}

/* The wire and KV number types, and whether frames are sealed. */
static int parse_types(struct kvr_plan *p, json_t *root, struct kvr_err *err)
{
    json_t *v;
    p->wire_dtype = KVR_DTYPE_F32;
    if ((v = json_object_get(root, "wire_dtype"))) {
        int t = kvr_dtype_by_name(json_is_string(v) ? json_string_value(v) : "");
        if (t >= 0 && dtype_name((enum kvr_dtype)t))
            p->wire_dtype = (enum kvr_dtype)t;
        else
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: wire_dtype must be \"f32\", \"f16\" or \"bf16\"");
    }

    p->kv_type = KVR_PLAN_DEFAULT_KV_TYPE;
    if ((v = json_object_get(root, "kv_type")) &&
        kvr_plan_kv_type_parse(json_is_string(v) ? json_string_value(v) : "", &p->kv_type))
        return kvr_err_set(err, KVR_EINVAL, "plan: kv_type must be \"f32\", \"f16\" or \"q8_0\"");

    p->encrypt = true;
    if ((v = json_object_get(root, "encrypt"))) {
        if (!json_is_boolean(v))
            return kvr_err_set(err, KVR_EINVAL, "plan: encrypt must be true or false");
        p->encrypt = json_is_true(v);
    }
    return KVR_OK;
}

/* The ring's shared secret: inline hex digits or a file's path, not both. */
static int parse_secret(struct kvr_plan *p, json_t *root, struct kvr_err *err)
{
    json_t *secret = json_object_get(root, "secret");
    json_t *secret_file = json_object_get(root, "secret_file");
    if (secret && secret_file)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: give either \"secret\" or \"secret_file\", not both");
    if (secret) {
        if (!json_is_string(secret))
            return kvr_err_set(err, KVR_EINVAL, "plan: secret must be a string of hex digits");
        const char *s = json_string_value(secret);
        long nb = hex_decode(s, strlen(s), p->secret, sizeof p->secret);
        if (nb < 0)
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: secret must be an even number of hex digits, at most %d",
                               2 * KVR_PLAN_SECRET_MAX_BYTES);
        p->secret_bytes = (uint32_t)nb;
        p->secret_inline = true;
    }
    if (secret_file)
        return get_str(secret_file, "secret_file", p->secret_file, sizeof p->secret_file, err);
    return KVR_OK;
}

static int parse_root(struct kvr_plan *p, json_t *root, struct kvr_err *err)
{
    static const char *const keys[] = {"model",
                                       "model_fingerprint",
                                       "stages",
                                       "bridge",
                                       "row_width",
                                       "microbatches",
                                       "max_seqs",
                                       "n_ctx",
                                       "kv_block_tokens",
                                       "kv_blocks",
                                       "wire_dtype",
                                       "threads",
                                       "secret",
                                       "secret_file",
                                       "encrypt",
                                       "kv_type",
                                       "experts",
                                       "spares",
                                       NULL};
    int rc;
    if (!json_is_object(root))
        return kvr_err_set(err, KVR_EINVAL, "plan: the top level must be a JSON object");
    if ((rc = check_keys(root, keys, "the plan", err)) || (rc = parse_places(p, root, err)) ||
        (rc = parse_sizes(p, root, err)) || (rc = parse_types(p, root, err)) ||
        (rc = parse_secret(p, root, err)) ||
        (rc = kvr_plan_experts_parse(p, json_object_get(root, "experts"), err)))
        return rc;
    return kvr_plan_spares_parse(p, json_object_get(root, "spares"), err);
}

int kvr_plan_parse(struct kvr_plan *plan, const char *json, size_t len, const char *dir,
                   struct kvr_err *err)
{
    memset(plan, 0, sizeof *plan);
    int rc = KVR_OK;
    if (dir && (rc = copy_str(plan->dir, sizeof plan->dir, dir, "plan folder", err)))
        return rc;
    json_error_t jerr;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        rc = kvr_err_set(err, KVR_EFORMAT, "plan: line %d, column %d: %s", jerr.line, jerr.column,
                         jerr.text);
        goto fail;
    }
    rc = parse_root(plan, root, err);
    json_decref(root);
    if (rc == KVR_OK)
        return KVR_OK;
fail:
    kvr_plan_wipe(plan);
    memset(plan, 0, sizeof *plan);
    return rc;
}

/* Read a whole (small) file into a NUL-terminated heap buffer. */
static int read_small_file(const char *path, size_t max_bytes, char **out, size_t *out_len,
                           const char *what, struct kvr_err *err)
{
    int rc = KVR_OK;
    char *buf = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvr_err_set(err, KVR_EIO, "%s %s: %s", what, path, strerror(errno));
    buf = kvr_malloc(max_bytes + 1);
    if (!buf) {
        rc = kvr_err_set(err, KVR_ENOMEM, "%s %s: out of memory", what, path);
        goto close_file;
    }
    size_t n = fread(buf, 1, max_bytes + 1, f);
    if (ferror(f)) {
        rc = kvr_err_set(err, KVR_EIO, "%s %s: read error", what, path);
        goto free_buf;
    }
    if (n > max_bytes) {
        rc = kvr_err_set(err, KVR_ERANGE, "%s %s is larger than %zu bytes", what, path, max_bytes);
        goto free_buf;
    }
    buf[n] = 0;
    *out = buf;
    *out_len = n;
    fclose(f);
    return KVR_OK;
free_buf:
    sodium_memzero(buf, max_bytes + 1);
    kvr_free(buf);
close_file:
    fclose(f);
    return rc;
}

/* Read the secret from `path`: a regular file private to its owner, hex digits with
 * whitespace around them. */
static int read_secret_path(struct kvr_plan *plan, const char *path, struct kvr_err *err)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return kvr_err_set(err, KVR_EIO, "secret_file %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return kvr_err_set(err, KVR_EINVAL, "secret_file %s is not a regular file", path);
    if (sb.st_mode & (S_IRWXG | S_IRWXO))
        return kvr_err_set(err, KVR_EINVAL,
                           "secret_file %s has mode %04o: its group or others may read it; "
                           "the cluster secret must be private to its owner (chmod 600 %s)",
                           path, (unsigned)(sb.st_mode & 07777), path);
    char *text = NULL;
    size_t len = 0;
    int rc = read_small_file(path, SECRET_FILE_MAX_BYTES, &text, &len, "secret_file", err);
    if (rc)
        return rc;
    size_t b = 0, e = len;
    while (b < e && strchr(" \t\r\n", text[b]))
        b++;
    while (e > b && strchr(" \t\r\n", text[e - 1]))
        e--;
    long nb = hex_decode(text + b, e - b, plan->secret, sizeof plan->secret);
    sodium_memzero(text, len);
    kvr_free(text);
    if (nb < 0)
        return kvr_err_set(err, KVR_EINVAL,
                           "secret_file %s must hold an even number of hex digits (at most "
                           "%d), e.g. from `openssl rand -hex 32`",
                           path, 2 * KVR_PLAN_SECRET_MAX_BYTES);
    plan->secret_bytes = (uint32_t)nb;
    plan->secret_inline = false;
    return KVR_OK;
}

int kvr_plan_read_secret(struct kvr_plan *plan, struct kvr_err *err)
{
    if (!plan->secret_file[0])
        return KVR_OK;
    char path[KVR_PLAN_PATH_BYTES];
    int rc = kvr_plan_path(plan, plan->secret_file, path, sizeof path, err);
    return rc ? rc : read_secret_path(plan, path, err);
}

int kvr_plan_use_secret_file(struct kvr_plan *plan, const char *path, struct kvr_err *err)
{
    sodium_memzero(plan->secret, sizeof plan->secret);
    plan->secret_bytes = 0;
    int rc = copy_str(plan->secret_file, sizeof plan->secret_file, path, "secret_file", err);
    return rc ? rc : read_secret_path(plan, path, err);
}

int kvr_plan_write_secret_file(struct kvr_plan *plan, const char *path, const char *ref,
                               struct kvr_err *err)
{
    char hex[2 * KVR_PLAN_SECRET_MAX_BYTES + 2];
    if (plan->secret_bytes == 0 || plan->secret_bytes > sizeof plan->secret)
        return kvr_err_set(err, KVR_EINVAL, "plan: no secret to write");
    int rc = copy_str(plan->secret_file, sizeof plan->secret_file, ref, "secret_file", err);
    if (rc)
        return rc;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return kvr_err_set(err, KVR_EIO, "secret_file %s: %s", path, strerror(errno));
    sodium_bin2hex(hex, sizeof hex - 1, plan->secret, plan->secret_bytes);
    size_t n = strlen(hex);
    hex[n++] = '\n';
    bool ok = write(fd, hex, n) == (ssize_t)n;
    ok = fsync(fd) == 0 && ok;
    ok = close(fd) == 0 && ok;
    sodium_memzero(hex, sizeof hex);
    if (!ok) {
        unlink(path);
        return kvr_err_set(err, KVR_EIO, "secret_file %s: write failed", path);
    }
    plan->secret_inline = false;
    return KVR_OK;
}

int kvr_plan_load(struct kvr_plan *plan, const char *path, struct kvr_err *err)
{
    return kvr_plan_load_with_secret(plan, path, NULL, err);
}

int kvr_plan_load_with_secret(struct kvr_plan *plan, const char *path, const char *secret_file,
                              struct kvr_err *err)
{
    char dir[KVR_PLAN_PATH_BYTES];
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) : 0;
    if (slash && dir_len == 0)
        dir_len = 1; /* "/plan.json": the root folder */
    if (dir_len >= sizeof dir)
        return kvr_err_set(err, KVR_ERANGE, "plan %s: folder name too long", path);
    memcpy(dir, path, dir_len);
    dir[dir_len] = 0;

    char *text = NULL;
    size_t len = 0;
    int rc = read_small_file(path, PLAN_FILE_MAX_BYTES, &text, &len, "plan", err);
    if (rc)
        return rc;
    rc = kvr_plan_parse(plan, text, len, dir, err);
    sodium_memzero(text, len);
    kvr_free(text);
    if (rc == KVR_OK && (rc = secret_file ? kvr_plan_use_secret_file(plan, secret_file, err)
                                          : kvr_plan_read_secret(plan, err)))
        kvr_plan_wipe(plan);
    if (rc == KVR_OK && plan->secret_inline)
        KVR_WARN("plan %s holds the cluster secret inline: move it to a secret_file of mode "
                 "0600 (docs/PLAN.md), so the plan can be shared without it",
                 path);
    if (rc && err) {
        /* Prefix the file name, which the parser did not know. */
        char msg[KVR_ERR_MSG_BYTES];
        snprintf(msg, sizeof msg, "%s", err->msg);
        kvr_err_set(err, rc, "%s: %s", path, msg);
    }
    return rc;
}

int kvr_plan_path(const struct kvr_plan *plan, const char *rel, char *out, size_t out_cap,
                  struct kvr_err *err)
{
    int n;
    if (rel[0] == '/' || !plan->dir[0])
        n = snprintf(out, out_cap, "%s", rel);
    else
        n = snprintf(out, out_cap, "%s%s%s", plan->dir,
                     plan->dir[strlen(plan->dir) - 1] == '/' ? "" : "/", rel);
    if (n < 0 || (size_t)n >= out_cap)
        return kvr_err_set(err, KVR_ERANGE, "path %s/%s is too long", plan->dir, rel);
    return KVR_OK;
}

void kvr_plan_wipe(struct kvr_plan *plan)
{
    sodium_memzero(plan->secret, sizeof plan->secret);
    plan->secret_bytes = 0;
}

/* ---- Validation ------------------------------------------------------------------------ */

static int check_addr(const char *addr, const char *who, struct kvr_err *err)
{
    char host[KVR_ADDR_HOST_BYTES];
    uint16_t port;
    struct kvr_err e = {0};
    if (kvr_addr_parse(addr, host, sizeof host, &port, false, &e))
        return kvr_err_set(err, KVR_EINVAL, "plan: %s address \"%s\": %s", who, addr, e.msg);
    return KVR_OK;
}

static int check_ranges(const struct kvr_plan *p, uint32_t n_layer, struct kvr_err *err)
{
    /* Each range on its own, then their order, then that they tile the model: so a list
     * that is merely out of order is reported as such, not as a gap or an overlap. */
    for (uint32_t i = 0; i < p->n_stages; i++) {
        const struct kvr_plan_stage *s = &p->stages[i];
        if (s->first_layer > s->last_layer)
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: stage %u has layers [%u, %u]: the first layer must not "
                               "come after the last",
                               i, s->first_layer, s->last_layer);
        if (s->last_layer >= KVR_PLAN_MAX_LAYERS)
            return kvr_err_set(err, KVR_ERANGE,
                               "plan: stage %u has layers [%u, %u], beyond the bound of %d "
                               "layers",
                               i, s->first_layer, s->last_layer, KVR_PLAN_MAX_LAYERS);
        if (n_layer && s->last_layer >= n_layer)
            return kvr_err_set(err, KVR_ERANGE,
                               "plan: stage %u has layers [%u, %u], outside the model, which "
                               "has %u layers (0..%u)",
                               i, s->first_layer, s->last_layer, n_layer, n_layer - 1);
    }
    for (uint32_t i = 1; i < p->n_stages; i++) {
        const struct kvr_plan_stage *s = &p->stages[i], *q = &p->stages[i - 1];
        if (s->first_layer < q->first_layer)
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: stage %u [%u, %u] is listed after stage %u [%u, %u] but "
                               "holds earlier layers: list stages in layer order, head first",
                               i, s->first_layer, s->last_layer, i - 1, q->first_layer,
                               q->last_layer);
    }
    if (p->stages[0].first_layer != 0)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: stage 0 (the head) starts at layer %u: layers 0..%u are not "
                           "assigned to any stage",
                           p->stages[0].first_layer, p->stages[0].first_layer - 1);
    for (uint32_t i = 1; i < p->n_stages; i++) {
        const struct kvr_plan_stage *s = &p->stages[i], *q = &p->stages[i - 1];
        uint64_t next = (uint64_t)q->last_layer + 1;
        if (s->first_layer < next)
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: stages %u [%u, %u] and %u [%u, %u] overlap on layers "
                               "%u..%u: every layer belongs to exactly one stage",
                               i - 1, q->first_layer, q->last_layer, i, s->first_layer,
                               s->last_layer, s->first_layer,
                               s->last_layer < q->last_layer ? s->last_layer : q->last_layer);
        if (s->first_layer > next)
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: layers %" PRIu64 "..%u are not assigned to any stage "
                               "(gap between stage %u [%u, %u] and stage %u [%u, %u])",
                               next, s->first_layer - 1, i - 1, q->first_layer, q->last_layer, i,
                               s->first_layer, s->last_layer);
    }
    uint32_t end = p->stages[p->n_stages - 1].last_layer;
    if (n_layer && end + 1 < n_layer)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: layers %u..%u of the model are not assigned to any stage "
                           "(the tail, stage %u, ends at layer %u)",
                           end + 1, n_layer - 1, p->n_stages - 1, end);
    return KVR_OK;
}

static int check_width(uint32_t v, uint32_t max, const char *name, const char *why,
                       struct kvr_err *err)
{
    if (v == 0)
        return kvr_err_set(err, KVR_ERANGE, "plan: %s is 0: %s", name, why);
    if (v > max)
        return kvr_err_set(err, KVR_ERANGE, "plan: %s is %u, beyond the sane bound of %u (a typo?)",
                           name, v, max);
    return KVR_OK;
}

/* Addresses: well-formed and pairwise distinct, the bridge's included. */
static int check_addrs(const struct kvr_plan *p, struct kvr_err *err)
{
    int rc;
    char who[32];
    for (uint32_t i = 0; i < p->n_stages; i++) {
        snprintf(who, sizeof who, "stage %u", i);
        if ((rc = check_addr(p->stages[i].addr, who, err)))
            return rc;
    }
    if ((rc = check_addr(p->bridge_addr, "bridge", err)))
        return rc;
    for (uint32_t i = 0; i < p->n_stages; i++) {
        if (kvr_addr_equal(p->stages[i].addr, p->bridge_addr))
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: stage %u and the bridge both use address %s: every "
                               "process listens on its own address",
                               i, p->bridge_addr);
        for (uint32_t j = 0; j < i; j++)
            if (kvr_addr_equal(p->stages[i].addr, p->stages[j].addr))
                return kvr_err_set(err, KVR_EINVAL,
                                   "plan: stages %u and %u both use address %s: every process "
                                   "listens on its own address",
                                   j, i, p->stages[i].addr);
    }
    return KVR_OK;
}

/* Every size nonzero and within its sane bound, and the KV cache holds one full context. */
static int check_sizes(const struct kvr_plan *p, struct kvr_err *err)
{
    int rc;
    if ((rc = check_width(p->row_width, KVR_PLAN_MAX_ROW_WIDTH, "row_width",
                          "a micro-batch must carry at least one row", err)) ||
        (rc = check_width(p->microbatches, KVR_PLAN_MAX_MICROBATCHES, "microbatches",
                          "at least one micro-batch must be in flight", err)) ||
        (rc = check_width(p->max_seqs, KVR_PLAN_MAX_SEQS, "max_seqs",
                          "at least one sequence must fit", err)) ||
        (rc = check_width(p->n_ctx, KVR_PLAN_MAX_CTX, "n_ctx",
                          "a sequence needs at least one position", err)) ||
        (rc = check_width(p->kv_block_tokens, KVR_PLAN_MAX_KV_BLOCK_TOKENS, "kv_block_tokens",
                          "a KV block holds at least one token", err)) ||
        (rc = check_width(p->kv_blocks, UINT32_MAX, "kv_blocks",
                          "the KV cache needs at least one block", err)))
        return rc;
    uint64_t kv_tokens = (uint64_t)p->kv_blocks * p->kv_block_tokens;
    uint64_t need = ((uint64_t)p->n_ctx + p->kv_block_tokens - 1) / p->kv_block_tokens;
    if (p->kv_blocks < need)
        return kvr_err_set(err, KVR_ERANGE,
                           "plan: kv_blocks %u x kv_block_tokens %u = %" PRIu64
                           " tokens cannot hold one sequence of n_ctx %u tokens (needs at "
                           "least %" PRIu64 " blocks)",
                           p->kv_blocks, p->kv_block_tokens, kv_tokens, p->n_ctx, need);
    if (kv_tokens > KVR_PLAN_MAX_KV_TOKENS)
        return kvr_err_set(err, KVR_ERANGE,
                           "plan: kv_blocks %u x kv_block_tokens %u = %" PRIu64
                           " tokens per layer, beyond the bound of %llu",
                           p->kv_blocks, p->kv_block_tokens, kv_tokens,
                           (unsigned long long)KVR_PLAN_MAX_KV_TOKENS);
    return KVR_OK;
}

/* Number types known, thread counts within bound. */
static int check_types(const struct kvr_plan *p, struct kvr_err *err)
{
    if (!dtype_name(p->wire_dtype))
        return kvr_err_set(err, KVR_EINVAL, "plan: wire_dtype %d is not f32, f16 or bf16",
                           (int)p->wire_dtype);
    if (!kvr_plan_kv_type_name(p->kv_type))
        return kvr_err_set(err, KVR_EINVAL, "plan: kv_type %d is not f32, f16 or q8_0",
                           (int)p->kv_type);
    if (p->n_threads > KVR_PLAN_MAX_THREADS)
        return kvr_err_set(err, KVR_ERANGE, "plan: threads is %u, beyond the bound of %d",
                           p->n_threads, KVR_PLAN_MAX_THREADS);
    for (uint32_t i = 0; i < p->n_stages; i++)
        if (p->stages[i].n_threads > KVR_PLAN_MAX_THREADS)
            return kvr_err_set(err, KVR_ERANGE,
                               "plan: stage %u has threads %u, beyond the bound of %d", i,
                               p->stages[i].n_threads, KVR_PLAN_MAX_THREADS);
    return KVR_OK;
}

/* The cluster secret was given (or read from its file) and has a usable length. */
static int check_secret(const struct kvr_plan *p, struct kvr_err *err)
{
    if (p->secret_bytes == 0 && p->secret_file[0])
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: secret_file \"%s\" has not been read (kvr_plan_load reads "
                           "it) or is empty",
                           p->secret_file);
    if (p->secret_bytes == 0)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan has no cluster secret: add \"secret\" (hex, at least %d "
                           "digits) or \"secret_file\"",
                           2 * KVR_PLAN_SECRET_MIN_BYTES);
    if (p->secret_bytes < KVR_PLAN_SECRET_MIN_BYTES || p->secret_bytes > sizeof p->secret)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: the cluster secret is %u bytes; it must be %d to %d bytes "
                           "(%d to %d hex digits)",
                           p->secret_bytes, KVR_PLAN_SECRET_MIN_BYTES, KVR_PLAN_SECRET_MAX_BYTES,
                           2 * KVR_PLAN_SECRET_MIN_BYTES, 2 * KVR_PLAN_SECRET_MAX_BYTES);
    return KVR_OK;
}

int kvr_plan_validate(const struct kvr_plan *p, uint32_t n_layer, struct kvr_err *err)
{
    int rc;
    if (!p->model_path[0])
        return kvr_err_set(err, KVR_EINVAL, "plan: no model file (\"model\")");
    if (p->n_stages < 2)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan has %u stage%s: a pipeline needs at least two stages: head "
                           "and tail are different roles (the head embeds tokens, the tail "
                           "samples them); for one process use `kvasir run`",
                           p->n_stages, p->n_stages == 1 ? "" : "s");
    if (p->n_stages > KVR_PLAN_MAX_STAGES)
        return kvr_err_set(err, KVR_ERANGE, "plan: %u stages; at most %d are supported",
                           p->n_stages, KVR_PLAN_MAX_STAGES);
    if ((rc = check_ranges(p, n_layer, err)) || (rc = check_addrs(p, err)) ||
        (rc = check_sizes(p, err)) || (rc = check_types(p, err)) || (rc = check_secret(p, err)) ||
        (rc = kvr_plan_experts_validate(p, n_layer, err)))
        return rc;
    return kvr_plan_spares_validate(p, err);
}

int kvr_plan_check_fingerprint(const struct kvr_plan *plan, uint64_t fingerprint,
                               struct kvr_err *err)
{
    if (plan->model_fingerprint && plan->model_fingerprint != fingerprint)
        return kvr_err_set(err, KVR_EINVAL,
                           "model %s has fingerprint 0x%016" PRIx64 " but the plan expects "
                           "0x%016" PRIx64 ": not the file the plan was made for (every "
                           "stage needs the same model file)",
                           plan->model_path, fingerprint, plan->model_fingerprint);
    return KVR_OK;
}

/* ---- Hash ------------------------------------------------------------------------------ */

/* Canonical serialization, fed to BLAKE2b-256 field by field (docs/PLAN.md):
 *
 *   "kvasir-plan-1"  13 bytes, domain separation
 *   u64  model_fingerprint
 *   u32  n_stages
 *   per stage:  u32 addr length, addr bytes, u32 first_layer, u32 last_layer
 *   u32  bridge addr length, bridge addr bytes
 *   u32  row_width, microbatches, max_seqs, n_ctx, kv_block_tokens, kv_blocks, wire_dtype
 *   u32  encrypt (1 or 0)
 *   u32  kv_type (GGUF type id: f32 0, f16 1, q8_0 8)
 *   u32  epoch, only when it is not 0 (a re-planned ring, propose.h kvr_plan_replan)
 *   with expert agents only: u32 n_agents, per agent u32 addr length, addr bytes,
 *        u32 n_holds, per hold u32 first_layer, last_layer, first_expert, last_expert
 *   with spare stages only: u32 n_spares, per spare u32 addr length, addr bytes
 *
 * Integers are little-endian. Lengths prefix strings so that no two plans serialize alike. */
static void hash_u32(crypto_generichash_state *st, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    crypto_generichash_update(st, b, sizeof b);
}

static void hash_str(crypto_generichash_state *st, const char *s)
{
    size_t n = strnlen(s, KVR_PLAN_ADDR_BYTES);
    hash_u32(st, (uint32_t)n);
    crypto_generichash_update(st, (const unsigned char *)s, n);
}

void kvr_plan_hash_u32(crypto_generichash_state *st, uint32_t v)
{
    hash_u32(st, v);
}
void kvr_plan_hash_str(crypto_generichash_state *st, const char *s)
{
    hash_str(st, s);
}

void kvr_plan_hash(const struct kvr_plan *p, uint8_t hash[KVR_PLAN_HASH_BYTES])
{
    static const char domain[] = "kvasir-plan-1";
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, KVR_PLAN_HASH_BYTES);
    crypto_generichash_update(&st, (const unsigned char *)domain, sizeof domain - 1);
    hash_u32(&st, (uint32_t)p->model_fingerprint);
    hash_u32(&st, (uint32_t)(p->model_fingerprint >> 32));
    uint32_t n = p->n_stages > KVR_PLAN_MAX_STAGES ? KVR_PLAN_MAX_STAGES : p->n_stages;
    hash_u32(&st, n);
    for (uint32_t i = 0; i < n; i++) {
        hash_str(&st, p->stages[i].addr);
        hash_u32(&st, p->stages[i].first_layer);
        hash_u32(&st, p->stages[i].last_layer);
    }
    hash_str(&st, p->bridge_addr);
    const uint32_t widths[] = {
        p->row_width, p->microbatches,        p->max_seqs, p->n_ctx, p->kv_block_tokens,
        p->kv_blocks, (uint32_t)p->wire_dtype};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        hash_u32(&st, widths[i]);
    hash_u32(&st, p->encrypt ? 1 : 0);
    hash_u32(&st, (uint32_t)p->kv_type);
    if (p->epoch) /* plans as loaded (epoch 0) keep the hash they always had */
        hash_u32(&st, p->epoch);
    kvr_plan_experts_hash(p, &st);
    kvr_plan_spares_hash(p, &st);
    crypto_generichash_final(&st, hash, KVR_PLAN_HASH_BYTES);
}

void kvr_plan_hash_hex(const uint8_t hash[KVR_PLAN_HASH_BYTES], size_t n_bytes, char *out,
                       size_t out_cap)
{
    static const char digits[] = "0123456789abcdef";
    if (out_cap == 0)
        return;
    if (n_bytes > KVR_PLAN_HASH_BYTES)
        n_bytes = KVR_PLAN_HASH_BYTES;
    size_t o = 0;
    for (size_t i = 0; i < n_bytes && o + 2 < out_cap; i++) {
        out[o++] = digits[hash[i] >> 4];
        out[o++] = digits[hash[i] & 15];
    }
    out[o] = 0;
}

/* ---- Writing --------------------------------------------------------------------------- */

int kvr_plan_to_json(const struct kvr_plan *p, char **out, struct kvr_err *err)
{
    int rc = KVR_ENOMEM;
    char *dumped = NULL;
    char hex[2 * KVR_PLAN_SECRET_MAX_BYTES + 1];
    char fp[24];
    *out = NULL;
    json_t *root = json_object();
    json_t *stages = json_array();
    if (!root || !stages)
        goto fail;
    snprintf(fp, sizeof fp, "0x%016" PRIx64, p->model_fingerprint);
    bool ok = !json_object_set_new(root, "model", json_string(p->model_path)) &&
              !json_object_set_new(root, "model_fingerprint", json_string(fp));
    for (uint32_t i = 0; ok && i < p->n_stages && i < KVR_PLAN_MAX_STAGES; i++) {
        const struct kvr_plan_stage *s = &p->stages[i];
        json_t *st = json_pack("{s:s, s:[I, I]}", "addr", s->addr, "layers",
                               (json_int_t)s->first_layer, (json_int_t)s->last_layer);
        ok = st &&
             (!s->n_threads || !json_object_set_new(st, "threads", json_integer(s->n_threads)));
        ok = ok && !json_array_append_new(stages, st);
    }
    ok = ok && !json_object_set(root, "stages", stages);
    ok = ok && !json_object_set_new(root, "bridge", json_string(p->bridge_addr));
    const struct {
        const char *key;
        uint32_t v;
    } ints[] = {
        {"row_width", p->row_width},
        {"microbatches", p->microbatches},
        {"max_seqs", p->max_seqs},
        {"n_ctx", p->n_ctx},
        {"kv_block_tokens", p->kv_block_tokens},
        {"kv_blocks", p->kv_blocks},
    };
    for (size_t i = 0; ok && i < sizeof ints / sizeof ints[0]; i++)
        ok = !json_object_set_new(root, ints[i].key, json_integer(ints[i].v));
    const char *dt = dtype_name(p->wire_dtype);
    if (!dt) {
        rc = kvr_err_set(err, KVR_EINVAL, "plan: wire_dtype %d cannot be written",
                         (int)p->wire_dtype);
        goto fail;
    }
    ok = ok && !json_object_set_new(root, "wire_dtype", json_string(dt));
    const char *kt = kvr_plan_kv_type_name(p->kv_type);
    ok = ok && kt && !json_object_set_new(root, "kv_type", json_string(kt));
    ok = ok && !json_object_set_new(root, "threads", json_integer(p->n_threads));
    ok = ok && !json_object_set_new(root, "encrypt", json_boolean(p->encrypt));
    ok = ok && !kvr_plan_experts_to_json(p, root);
    ok = ok && !kvr_plan_spares_to_json(p, root);
    if (p->secret_file[0]) {
        ok = ok && !json_object_set_new(root, "secret_file", json_string(p->secret_file));
    } else {
        uint32_t nb = p->secret_bytes > sizeof p->secret ? sizeof p->secret : p->secret_bytes;
        sodium_bin2hex(hex, sizeof hex, p->secret, nb);
        ok = ok && !json_object_set_new(root, "secret", json_string(hex));
    }
    if (!ok || !(dumped = json_dumps(root, JSON_INDENT(2))))
        goto fail;
    size_t n = strlen(dumped);
    if (!(*out = kvr_malloc(n + 2)))
        goto fail;
    memcpy(*out, dumped, n);
    (*out)[n] = '\n';
    (*out)[n + 1] = 0;
    rc = KVR_OK;
fail:
    if (rc == KVR_ENOMEM)
        kvr_err_set(err, rc, "plan: out of memory writing JSON");
    if (dumped) {
        sodium_memzero(dumped, strlen(dumped));
        free(dumped); /* allocated by jansson */
    }
    sodium_memzero(hex, sizeof hex);
    json_decref(stages);
    json_decref(root);
    return rc;
}

int kvr_plan_write(const struct kvr_plan *plan, const char *path, struct kvr_err *err)
{
    char tmp[KVR_PLAN_PATH_BYTES + 32];
    char *text = NULL;
    int rc = kvr_plan_to_json(plan, &text, err);
    if (rc)
        return rc;
    int n = snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    if (n < 0 || (size_t)n >= sizeof tmp) {
        rc = kvr_err_set(err, KVR_ERANGE, "plan path %s is too long", path);
        goto free_text;
    }
    /* 0600 from the start: the plan may hold the cluster secret inline. */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!f) {
        rc = kvr_err_set(err, KVR_EIO, "%s: %s", tmp, strerror(errno));
        if (fd >= 0)
            close(fd);
        goto free_text;
    }
    size_t len = strlen(text);
    bool ok = fwrite(text, 1, len, f) == len;
    ok = (fflush(f) == 0) && ok;
    ok = (fsync(fileno(f)) == 0) && ok;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        rc = kvr_err_set(err, KVR_EIO, "writing %s: %s", path, strerror(errno));
        unlink(tmp);
    }
free_text:
    sodium_memzero(text, strlen(text));
    kvr_free(text);
    return rc;
}

/* ---- Planner --------------------------------------------------------------------------- */

struct balance_ctx {
    const struct kvr_balance_input *in;
    const double *pre_cost;  /* prefix sums, n_layer + 1 */
    const double *pre_bytes; /* prefix sums, or NULL */
};

/* Time of stage s holding layers [j, i), or INFINITY if it breaks its memory budget. */
static double stage_time(const struct balance_ctx *c, uint32_t s, uint32_t j, uint32_t i)
{
    const struct kvr_balance_input *in = c->in;
    bool head = s == 0, tail = s + 1 == in->n_stages;
    if (c->pre_bytes && in->stage_mem) {
        double mem = c->pre_bytes[i] - c->pre_bytes[j] + (head ? in->head_bytes : 0) +
                     (tail ? in->tail_bytes : 0);
        if (mem > in->stage_mem[s])
            return INFINITY;
    }
    double cost =
        c->pre_cost[i] - c->pre_cost[j] + (head ? in->head_cost : 0) + (tail ? in->tail_cost : 0);
    return cost / (in->stage_speed ? in->stage_speed[s] : 1.0);
}

static int check_balance_input(const struct kvr_balance_input *in, struct kvr_err *err)
{
    if (in->n_stages < 2 || in->n_stages > KVR_PLAN_MAX_STAGES)
        return kvr_err_set(err, KVR_EINVAL, "planner: %u stages; a ring has 2 to %d", in->n_stages,
                           KVR_PLAN_MAX_STAGES);
    if (in->n_layer < in->n_stages)
        return kvr_err_set(err, KVR_EINVAL,
                           "planner: %u layers cannot be split over %u stages (each stage "
                           "needs at least one layer)",
                           in->n_layer, in->n_stages);
    if (in->n_layer > KVR_PLAN_MAX_LAYERS)
        return kvr_err_set(err, KVR_ERANGE, "planner: %u layers; at most %d", in->n_layer,
                           KVR_PLAN_MAX_LAYERS);
    if (!isfinite(in->head_cost) || in->head_cost < 0 || !isfinite(in->tail_cost) ||
        in->tail_cost < 0)
        return kvr_err_set(err, KVR_EINVAL, "planner: head and tail costs must be >= 0");
    for (uint32_t l = 0; in->layer_cost && l < in->n_layer; l++)
        if (!isfinite(in->layer_cost[l]) || in->layer_cost[l] < 0)
            return kvr_err_set(err, KVR_EINVAL, "planner: layer %u has cost %g; costs are >= 0", l,
                               in->layer_cost[l]);
    for (uint32_t s = 0; in->stage_speed && s < in->n_stages; s++)
        if (!isfinite(in->stage_speed[s]) || in->stage_speed[s] <= 0)
            return kvr_err_set(err, KVR_EINVAL, "planner: stage %u has speed %g; speeds are > 0", s,
                               in->stage_speed[s]);
    for (uint32_t l = 0; in->layer_bytes && l < in->n_layer; l++)
        if (!isfinite(in->layer_bytes[l]) || in->layer_bytes[l] < 0)
            return kvr_err_set(err, KVR_EINVAL, "planner: layer %u has %g bytes", l,
                               in->layer_bytes[l]);
    return KVR_OK;
}

/* Two dynamic programs over (stage s, layers [0, i) assigned to stages 0..s):
 *   1. best[s][i] = the smallest possible maximum stage time: gives T*.
 *   2. sq[s][i]   = the smallest sum of squared times with every stage <= T*; ties go to
 *                   the largest previous boundary j (earlier stages get more layers).
 * The path of (2) is the answer. Stage s may end at layer boundary i only if every later
 * stage can still get one layer: s + 1 <= i <= n_layer - (n_stages - 1 - s). */
int kvr_plan_balance(const struct kvr_balance_input *in, struct kvr_balance_result *out,
                     struct kvr_err *err)
{
    int rc = check_balance_input(in, err);
    if (rc)
        return rc;
    const uint32_t L = in->n_layer, S = in->n_stages;
    const size_t W = (size_t)L + 1;
    double *pre_cost = kvr_calloc(W, sizeof *pre_cost);
    double *pre_bytes = in->layer_bytes ? kvr_calloc(W, sizeof *pre_bytes) : NULL;
    double *best = kvr_malloc((size_t)S * W * sizeof *best);
    double *sq = kvr_malloc((size_t)S * W * sizeof *sq);
    uint32_t *from = kvr_malloc((size_t)S * W * sizeof *from);
    if (!pre_cost || (in->layer_bytes && !pre_bytes) || !best || !sq || !from) {
        rc = kvr_err_set(err, KVR_ENOMEM, "planner: out of memory");
        goto free_all;
    }
    for (uint32_t l = 0; l < L; l++) {
        pre_cost[l + 1] = pre_cost[l] + (in->layer_cost ? in->layer_cost[l] : 1.0);
        if (pre_bytes)
            pre_bytes[l + 1] = pre_bytes[l] + in->layer_bytes[l];
    }
    struct balance_ctx c = {in, pre_cost, pre_bytes};

    for (size_t k = 0; k < (size_t)S * W; k++)
        best[k] = sq[k] = INFINITY;
    for (uint32_t i = 1; i + (S - 1) <= L; i++)
        best[i] = stage_time(&c, 0, 0, i);
    for (uint32_t s = 1; s < S; s++)
        for (uint32_t i = s + 1; i + (S - 1 - s) <= L; i++)
            for (uint32_t j = s; j < i; j++) {
                double t = stage_time(&c, s, j, i), prev = best[(s - 1) * W + j];
                double m = t > prev ? t : prev;
                if (m < best[s * W + i])
                    best[s * W + i] = m;
            }
    double t_star = best[(S - 1) * W + L];
    if (!isfinite(t_star)) {
        rc = kvr_err_set(err, KVR_ERANGE,
                         "planner: no split of %u layers over %u stages fits the stages' "
                         "memory budgets",
                         L, S);
        goto free_all;
    }
    /* Stage times are recomputed by the same expression, so the optimum's own stages
     * compare <= t_star exactly; the slack only absorbs nothing-but-rounding near-ties. */
    double limit = t_star + fabs(t_star) * 1e-12;
    for (uint32_t i = 1; i + (S - 1) <= L; i++) {
        double t = stage_time(&c, 0, 0, i);
        if (t <= limit)
            sq[i] = t * t;
    }
    for (uint32_t s = 1; s < S; s++)
        for (uint32_t i = s + 1; i + (S - 1 - s) <= L; i++)
            for (uint32_t j = s; j < i; j++) {
                double t = stage_time(&c, s, j, i), prev = sq[(s - 1) * W + j];
                if (t > limit || !isfinite(prev))
                    continue;
                double v = prev + t * t, cur = sq[s * W + i];
                double eps = 1e-12 * (fabs(v) + fabs(cur) + 1e-300);
                if (!isfinite(cur) || v < cur - eps || (fabs(v - cur) <= eps)) {
                    /* j grows in the loop: on a tie the later boundary wins. */
                    sq[s * W + i] = v;
                    from[s * W + i] = j;
                }
            }
    uint32_t i = L;
    for (uint32_t s = S; s-- > 0;) {
        uint32_t j = s == 0 ? 0 : from[s * W + i];
        out->first_layer[s] = j;
        out->last_layer[s] = i - 1;
        out->stage_time[s] = stage_time(&c, s, j, i);
        i = j;
    }
    out->max_time = 0;
    for (uint32_t s = 0; s < S; s++)
        if (out->stage_time[s] > out->max_time)
            out->max_time = out->stage_time[s];
    rc = KVR_OK;
free_all:
    kvr_free(from);
    kvr_free(sq);
    kvr_free(best);
    kvr_free(pre_bytes);
    kvr_free(pre_cost);
    return rc;
}
