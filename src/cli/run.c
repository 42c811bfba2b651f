/* run.c - `kvasir run`: generate text from prompts.
 *
 *   kvasir run -m MODEL -p PROMPT -n N [sampling] [--threads T]      single process
 *   kvasir run --plan PLAN -p PROMPT -n N [sampling]                  through a live ring
 *   ... --prompts FILE --json                                         many prompts
 *
 * With one prompt the text is streamed to stdout as it is generated, then prompt and
 * decode speeds go to stderr. With --prompts (JSON lines: {"prompt": "...", "max_tokens":
 * N, "temperature": T, "seed": S, "top_k": K, "top_p": P, "min_p": M}, any field but the
 * prompt optional) every prompt runs: one after another, alone, in the single process (the
 * reference), or all at once through the ring ("repeat_penalty" may be given per prompt
 * too; and "prediction_ids", token ids the ring's speculation drafts from). --json prints one line
 * per prompt with the generated ids, which is what the ring tests compare.
 *
 * --force-ids FILE feeds a fixed id sequence instead of sampling (teacher forcing) and
 * prints, for every step, the forced id, the argmax, the margin between the two best
 * logits and the top logits; --logits N adds all logits of the first N steps. FILE is
 * refgen's JSON ({"prompt_ids": [...], "steps": [{"id": ...}, ...]}: the prompt, then the
 * peer's greedy ids), a JSON array of ids, or ids separated by spaces or commas. A plain
 * list is the sequence after the prompt of -p, or, without -p, its first id is the prompt.
 * Step k shows the logits after the prompt and the first k forced ids, so step k's argmax
 * is the model's guess for forced id k. */
#include "cli/cmd.h"
#include "cli/common.h"

#include "bridge/bridge.h"
#include "bridge/chat.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/gguf.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "ring/plan.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct job {
    char *prompt;
    bool special; /* the prompt is a rendered chat: control tokens are parsed */
    int32_t *ids; /* prompt ids */
    uint32_t n_ids;
    uint32_t max_tokens;
    struct kvr_sample_params sp;
    int32_t *out; /* generated ids */
    uint32_t n_out;
    const char *finish;
    int32_t *pred; /* --plan: "prediction_ids", the drafts' prediction (sched.h), or NULL */
    uint32_t n_pred;
};

struct run_opts {
    const char *model, *plan, *prompt, *prompts_file;
    uint32_t n_predict, threads, ctx;
    struct kvr_sample_params sp;
    bool ignore_eos, print_ids, json, quiet, batched, no_prefix_cache;
    enum kvr_spec_mode spec_mode; /* --plan: --spec (default auto) */
    bool chat;                    /* each prompt is a user message, formatted as a chat */
    const char *chat_template;    /* --chat-template NAME|FILE (implies --chat) */
    uint32_t row_width;
    enum kvr_dtype kv_type; /* --kv-type */
    const char *force_ids;  /* teacher-forcing input file */
    uint32_t n_top;         /* --force-ids: top logits per step */
    uint32_t n_logits;      /* --force-ids: steps whose full logits are printed */
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvasir run (-m MODEL | --plan PLAN) (-p PROMPT | --prompts FILE) [options]\n"
            "  -m, --model FILE       GGUF model (single process)\n"
            "      --plan FILE        run through the live ring this plan describes\n"
            "  -p, --prompt TEXT      prompt (BOS is added when the model wants it)\n"
            "      --prompts FILE     JSON lines, one prompt each (see docs)\n"
            "  -n, --n-predict N      tokens to generate (default 64)\n"
            "      --temp T           temperature, 0 = greedy (default 0.8)\n"
            "      --top-k K          (default 40)   --top-p P (default 0.95)\n"
            "      --min-p P          (default 0.05) --repeat-penalty R (default 1.0)\n"
            "      --seed S           RNG seed (default 42)\n"
            "  -t, --threads N        compute threads (default 2)\n"
            "  -c, --ctx N            context length (default: prompt + n, at most the model's;\n"
            "                         also --ctx-size)\n"
            "      --chat             send each prompt as a user message in the model's chat\n"
            "                         template (as /v1/chat/completions does)\n"
            "      --chat-template NAME|FILE  --chat with a built-in template or a Jinja file\n"
            "      --ignore-eos       keep generating after an end-of-generation token\n"
            "      --ids              print the generated token ids after the text\n"
            "      --json             one JSON line per prompt: ids and text\n"
            "      --batched          single process: run all prompts at once, continuous\n"
            "                         batching (default: one after another, each alone)\n"
            "      --row-width N      --batched: token rows per forward pass (default 64)\n"
            "      --no-prefix-cache  --plan: compute every prompt whole (no KV reuse)\n"
            "      --spec off|auto    --plan: speculation with lookup drafts (default auto)\n"
            "      --kv-type T        -m: KV cache values f32, f16 or q8_0 (default f16)\n"
            "      --force-ids FILE   teacher-forced: feed these ids, print each step's argmax,\n"
            "                         margin and top logits (refgen JSON or a list of ids)\n"
            "      --top N            --force-ids: top logits per step (default 5)\n"
            "      --logits N         --force-ids --json: all logits of the first N steps\n"
            "  -q, --quiet            no streamed text\n");
}

#define ARG(s, l) (!strcmp(a, s) || !strcmp(a, l))

/* An option without a value; false when `a` is not one. */
static bool parse_flag(struct run_opts *o, const char *a)
{
    if (ARG("--no-prefix-cache", "--no-prefix-cache"))
        o->no_prefix_cache = true;
    else if (ARG("--chat", "--chat"))
        o->chat = true;
    else if (ARG("--ignore-eos", "--ignore-eos"))
        o->ignore_eos = true;
    else if (ARG("--ids", "--ids"))
        o->print_ids = true;
    else if (ARG("--json", "--json"))
        o->json = true;
    else if (ARG("--batched", "--batched"))
        o->batched = true;
    else if (ARG("-q", "--quiet"))
        o->quiet = true;
    else
        return false;
    return true;
}

/* Sampling options with their value. Returns 0, 2 after printing why the value is wrong,
 * or 1 when `a` is not one of them. */
static int parse_sampling(struct run_opts *o, const char *a, const char *v)
{
    uint32_t k;
    char *end;
    if (ARG("--temp", "--temperature"))
        return kvr_cli_float(a, v, 0, 100, &o->sp.temperature) ? 2 : 0;
    if (ARG("--top-k", "--top-k")) {
        if (kvr_cli_u32(a, v, 0, 1u << 24, &k))
            return 2;
        o->sp.top_k = (int32_t)k;
        return 0;
    }
    if (ARG("--top-p", "--top-p"))
        return kvr_cli_float(a, v, 0, 1, &o->sp.top_p) ? 2 : 0;
    if (ARG("--min-p", "--min-p"))
        return kvr_cli_float(a, v, 0, 1, &o->sp.min_p) ? 2 : 0;
    if (ARG("--repeat-penalty", "--repeat-penalty"))
        return kvr_cli_float(a, v, 0.01f, 100, &o->sp.repeat_penalty) ? 2 : 0;
    if (ARG("--seed", "--seed")) {
        o->sp.seed = strtoull(v, &end, 10);
        if (*end) {
            fprintf(stderr, "kvasir run: --seed wants a number, not '%s'\n", v);
            return 2;
        }
        return 0;
    }
    return 1;
}

/* Every other option with a value. Returns as parse_sampling. */
static int parse_value(struct run_opts *o, const char *a, const char *v)
{
    if (ARG("-m", "--model"))
        o->model = v;
    else if (ARG("--plan", "--plan"))
        o->plan = v;
    else if (ARG("-p", "--prompt"))
        o->prompt = v;
    else if (ARG("--prompts", "--prompts"))
        o->prompts_file = v;
    else if (ARG("-n", "--n-predict"))
        return kvr_cli_u32(a, v, 1, 1u << 20, &o->n_predict) ? 2 : 0;
    else if (ARG("-t", "--threads"))
        return kvr_cli_u32(a, v, 1, 256, &o->threads) ? 2 : 0;
    else if (ARG("-c", "--ctx") || ARG("--ctx-size", "--ctx-size"))
        return kvr_cli_u32(a, v, 1, 1u << 20, &o->ctx) ? 2 : 0;
    else if (ARG("--chat-template", "--chat-template")) {
        o->chat = true;
        o->chat_template = v;
    } else if (ARG("--row-width", "--row-width"))
        return kvr_cli_u32(a, v, 1, 16384, &o->row_width) ? 2 : 0;
    else if (ARG("--kv-type", "--kv-type")) {
        if (kvr_plan_kv_type_parse(v, &o->kv_type)) {
            fprintf(stderr, "kvasir run: --kv-type is f32, f16 or q8_0, not '%s'\n", v);
            return 2;
        }
    } else if (ARG("--force-ids", "--force-ids"))
        o->force_ids = v;
    else if (ARG("--spec", "--spec")) {
        if (kvr_sched_spec_parse(v, &o->spec_mode)) {
            fprintf(stderr, "kvasir run: --spec is off or auto, not '%s'\n", v);
            return 2;
        }
    } else if (ARG("--top", "--top"))
        return kvr_cli_u32(a, v, 1, 1000, &o->n_top) ? 2 : 0;
    else if (ARG("--logits", "--logits"))
        return kvr_cli_u32(a, v, 0, 1u << 20, &o->n_logits) ? 2 : 0;
    else
        return parse_sampling(o, a, v);
    return 0;
}

#undef ARG

/* The options parse_value and parse_sampling take, each followed by its value. */
static bool takes_value(const char *a)
{
    static const char *const names[] = {
        "-m",          "--model",          "--plan",      "-p",
        "--prompt",    "--prompts",        "-n",          "--n-predict",
        "-t",          "--threads",        "-c",          "--ctx",
        "--temp",      "--temperature",    "--top-k",     "--top-p",
        "--min-p",     "--repeat-penalty", "--seed",      "--chat-template",
        "--row-width", "--kv-type",        "--force-ids", "--top",
        "--logits",    "--ctx-size",       "--spec"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(a, names[i]))
            return true;
    return false;
}

/* The options that only make sense together. Returns 0 or 2 after printing why. */
static int validate_args(const struct run_opts *o)
{
    if (!o->model == !o->plan) {
        fprintf(stderr, "kvasir run: give exactly one of -m MODEL and --plan PLAN\n");
        return 2;
    }
    if (o->force_ids && (o->plan || o->prompts_file || o->batched)) {
        fprintf(stderr, "kvasir run: --force-ids runs one sequence in a single process\n");
        return 2;
    }
    if (!o->force_ids && !o->prompt == !o->prompts_file) {
        fprintf(stderr, "kvasir run: give exactly one of -p PROMPT and --prompts FILE\n");
        return 2;
    }
    return 0;
}

/* Returns 0, 1 after --help, or 2 after printing what is wrong. */
static int parse_args(int argc, char **argv, struct run_opts *o)
{
    memset(o, 0, sizeof *o);
    o->n_predict = 64;
    o->threads = 2;
    o->row_width = 64;
    o->n_top = 5;
    o->kv_type = KVR_PLAN_DEFAULT_KV_TYPE;
    kvr_sample_params_default(&o->sp);
    o->spec_mode = KVR_SPEC_AUTO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--version")) {
            kvr_cli_version();
            return 1;
        }
        int gpu = kvr_cli_gpu_option("run", a, v);
        if (gpu) {
            i += gpu - 1;
            continue;
        }
        if (parse_flag(o, a))
            continue;
        if (!takes_value(a)) {
            kvr_cli_unknown_usage("run", a, usage);
            return 2;
        }
        if (!v) {
            fprintf(stderr, "kvasir run: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (parse_value(o, a, v))
            return 2;
    }
    return validate_args(o);
}

/* ---- jobs ------------------------------------------------------------------------------- */

/* An optional array of token ids (>= 0; the ring checks them against its vocabulary). */
static int json_field_ids(json_t *obj, const char *key, int32_t **ids, uint32_t *n, uint32_t line)
{
    json_t *a = json_object_get(obj, key), *v;
    if (!a)
        return 0;
    size_t i, len = json_is_array(a) ? json_array_size(a) : 0;
    if (!json_is_array(a) || len > (1u << 20) ||
        !(*ids = kvr_calloc(len ? len : 1, sizeof **ids))) {
        fprintf(stderr, "kvasir run: line %u: %s wants an array of token ids\n", line, key);
        return -1;
    }
    json_array_foreach(a, i, v)
    {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            fprintf(stderr, "kvasir run: line %u: %s[%zu] is not a token id\n", line, key, i);
            return -1;
        }
        (*ids)[i] = (int32_t)json_integer_value(v);
    }
    *n = (uint32_t)len;
    return 0;
}

static void free_jobs(struct job *jobs, uint32_t n)
{
    for (uint32_t i = 0; jobs && i < n; i++) {
        kvr_free(jobs[i].prompt);
        kvr_free(jobs[i].ids);
        kvr_free(jobs[i].out);
        kvr_free(jobs[i].pred);
    }
    kvr_free(jobs);
}

static int json_field_num(json_t *obj, const char *key, double lo, double hi, double *out,
                          uint32_t line)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return 0;
    if (!json_is_number(v) || json_number_value(v) < lo || json_number_value(v) > hi) {
        fprintf(stderr, "kvasir run: prompts line %u: \"%s\" must be a number in [%g, %g]\n", line,
                key, lo, hi);
        return -1;
    }
    *out = json_number_value(v);
    return 0;
}

static int json_field_f32(json_t *obj, const char *key, double lo, double hi, float *out,
                          uint32_t line)
{
    double d = *out;
    int rc = json_field_num(obj, key, lo, hi, &d, line);
    *out = (float)d;
    return rc;
}

/* Read the prompts (and per-prompt settings) into jobs. */
static int load_jobs(const struct run_opts *o, struct job **out, uint32_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    if (o->prompt) {
        struct job *j = kvr_calloc(1, sizeof *j);
        if (!j || !(j->prompt = kvr_strdup(o->prompt)))
            return -1;
        j->max_tokens = o->n_predict;
        j->sp = o->sp;
        *out = j;
        *n_out = 1;
        return 0;
    }
    FILE *f = fopen(o->prompts_file, "r");
    if (!f) {
        fprintf(stderr, "kvasir run: cannot open %s\n", o->prompts_file);
        return -1;
    }
    struct job *jobs = NULL;
    uint32_t n = 0, line = 0;
    char buf[65536];
    int rc = 0;
    while (fgets(buf, sizeof buf, f)) {
        line++;
        if (buf[0] == '\n' || buf[0] == 0)
            continue;
        json_error_t jerr;
        json_t *obj = json_loads(buf, 0, &jerr);
        json_t *p = obj ? json_object_get(obj, "prompt") : NULL;
        if (!json_is_string(p)) {
            fprintf(stderr, "kvasir run: %s line %u: want {\"prompt\": \"...\", ...}\n",
                    o->prompts_file, line);
            json_decref(obj);
            rc = -1;
            break;
        }
        struct job *grown = kvr_realloc(jobs, (n + 1) * sizeof *jobs);
        if (!grown) {
            json_decref(obj);
            rc = -1;
            break;
        }
        jobs = grown;
        struct job *j = &jobs[n++];
        memset(j, 0, sizeof *j);
        j->prompt = kvr_strdup(json_string_value(p));
        j->max_tokens = o->n_predict;
        j->sp = o->sp;
        double d = j->max_tokens;
        if (json_field_num(obj, "max_tokens", 1, 1 << 20, &d, line))
            rc = -1;
        j->max_tokens = (uint32_t)d;
        d = (double)j->sp.seed;
        if (json_field_num(obj, "seed", 0, 9007199254740992.0, &d, line))
            rc = -1;
        j->sp.seed = (uint64_t)d;
        d = j->sp.top_k;
        if (json_field_num(obj, "top_k", 0, 1 << 24, &d, line))
            rc = -1;
        j->sp.top_k = (int32_t)d;
        if (json_field_f32(obj, "temperature", 0, 100, &j->sp.temperature, line) ||
            json_field_f32(obj, "top_p", 0, 1, &j->sp.top_p, line) ||
            json_field_f32(obj, "min_p", 0, 1, &j->sp.min_p, line) ||
            json_field_f32(obj, "repeat_penalty", 0.01, 100, &j->sp.repeat_penalty, line))
            rc = -1;
        if (json_field_ids(obj, "prediction_ids", &j->pred, &j->n_pred, line))
            rc = -1;
        json_decref(obj);
        if (rc || !j->prompt) {
            rc = -1;
            break;
        }
    }
    fclose(f);
    if (rc || n == 0) {
        if (n == 0 && rc == 0)
            fprintf(stderr, "kvasir run: %s holds no prompts\n", o->prompts_file);
        free_jobs(jobs, n);
        return -1;
    }
    *out = jobs;
    *n_out = n;
    return 0;
}

/* A special token's text, or "" (buf holds it). */
static const char *token_text(const struct kvr_tok *tok, int32_t id, char *buf, size_t cap)
{
    const char *p;
    size_t n;
    buf[0] = 0;
    if (id >= 0 && kvr_tok_decode_piece(tok, id, true, &p, &n) == 0 && n < cap) {
        memcpy(buf, p, n);
        buf[n] = 0;
    }
    return buf;
}

/* --chat: every prompt becomes the chat prompt of one user message, rendered as the server
 * renders it (the model's template, or --chat-template), less a BOS text the tokenizer
 * adds itself. 0, or -1 after printing why. */
static int chat_jobs(const struct run_opts *o, const struct kvr_gguf *g, const struct kvr_tok *tok,
                     struct job *jobs, uint32_t n)
{
    char bos[256], eos[256];
    char *src = NULL;
    struct kvr_chat_config cc = {.bos_token = token_text(tok, kvr_tok_bos(tok), bos, sizeof bos),
                                 .eos_token = token_text(tok, kvr_tok_eos(tok), eos, sizeof eos)};
    if (o->chat_template) {
        if (kvr_cli_chat_template(o->chat_template, &cc.builtin, &src, &cc.jinja_len))
            return -1;
        cc.jinja = src;
    } else {
        struct kvr_gguf_str t = {0};
        if (kvr_gguf_get_str(g, "tokenizer.chat_template", &t, NULL) == 0) {
            cc.jinja = t.ptr;
            cc.jinja_len = (size_t)t.len;
        }
    }
    struct kvr_chat *chat = NULL;
    struct kvr_err err = {0};
    int rc = -1;
    if (kvr_chat_create(&chat, &cc, &err)) {
        fprintf(stderr, "kvasir run: chat template: %s\n", err.msg);
        goto out;
    }
    if (kvr_chat_source(chat) == KVR_CHAT_SOURCE_PLAIN)
        fprintf(stderr, "kvasir run: the model has no chat template; plain \"role: content\" "
                        "lines\n");
    time_t now_s = time(NULL);
    struct tm now;
    localtime_r(&now_s, &now);
    for (uint32_t i = 0; i < n; i++) {
        struct kvr_chat_msg m = {KVR_CHAT_ROLE_USER, jobs[i].prompt, strlen(jobs[i].prompt)};
        char *text;
        size_t len;
        if (kvr_chat_apply(chat, &m, 1, true, &now, &text, &len, &err)) {
            fprintf(stderr, "kvasir run: prompt %u: the chat template failed: %s\n", i, err.msg);
            goto out;
        }
        size_t skip = kvr_chat_bos_skip(text, len, cc.bos_token, kvr_tok_add_bos(tok));
        memmove(text, text + skip, len - skip + 1);
        kvr_free(jobs[i].prompt);
        jobs[i].prompt = text;
        jobs[i].special = true;
    }
    rc = 0;
out:
    kvr_chat_destroy(chat);
    kvr_free(src);
    return rc;
}

static int tokenize_jobs(const struct kvr_tok *tok, struct job *jobs, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        struct job *j = &jobs[i];
        size_t len = strlen(j->prompt);
        struct kvr_tok_scratch *sc = NULL;
        size_t cap = len + 8;
        j->ids = kvr_calloc(cap, sizeof *j->ids);
        j->out = kvr_calloc(j->max_tokens, sizeof *j->out);
        if (!j->ids || !j->out || kvr_tok_scratch_create(&sc, tok, len + 1)) {
            kvr_tok_scratch_destroy(sc);
            return -1;
        }
        int got = kvr_tok_encode(tok, sc, j->prompt, len, true, j->special, j->ids, cap);
        kvr_tok_scratch_destroy(sc);
        if (got <= 0) {
            fprintf(stderr, "kvasir run: prompt %u: cannot tokenize (%s)\n", i,
                    got < 0 ? kvr_strerror(got) : "empty");
            return -1;
        }
        j->n_ids = (uint32_t)got;
    }
    return 0;
}

/* Stream a job's new tokens as text (single prompt, not quiet). */
struct printer {
    const struct kvr_tok *tok;
    struct kvr_detok dt;
    char buf[1024];
    bool on;
};

static void print_token(struct printer *p, int32_t id)
{
    if (!p->on)
        return;
    int n = kvr_detok_push(p->tok, &p->dt, id, p->buf, sizeof p->buf);
    if (n > 0) {
        fwrite(p->buf, 1, (size_t)n, stdout);
        fflush(stdout);
    }
}

static void print_end(struct printer *p)
{
    if (!p->on)
        return;
    int n = kvr_detok_flush(&p->dt, p->buf, sizeof p->buf);
    if (n > 0)
        fwrite(p->buf, 1, (size_t)n, stdout);
    fputc('\n', stdout);
}

/* ---- single process --------------------------------------------------------------------- */

static void on_token(void *ud, uint32_t seq, int32_t id)
{
    (void)seq;
    print_token(ud, id);
}

/* The jobs as model/generate.h sequences (sharing their ids and out arrays); NULL when out
 * of memory. */
static struct kvr_generate_seq *gen_seqs(const struct job *jobs, uint32_t n_jobs)
{
    struct kvr_generate_seq *seqs = kvr_calloc(n_jobs, sizeof *seqs);
    for (uint32_t i = 0; seqs && i < n_jobs; i++)
        seqs[i] = (struct kvr_generate_seq){.ids = jobs[i].ids,
                                            .n_ids = jobs[i].n_ids,
                                            .max_tokens = jobs[i].max_tokens,
                                            .sp = jobs[i].sp,
                                            .out = jobs[i].out};
    return seqs;
}

/* Copy what generation filled back into the jobs. */
static void gen_results(struct job *jobs, const struct kvr_generate_seq *seqs, uint32_t n_jobs)
{
    for (uint32_t i = 0; i < n_jobs; i++) {
        jobs[i].n_out = seqs[i].n_out;
        jobs[i].finish = seqs[i].finish == KVR_GENERATE_STOP     ? "stop"
                         : seqs[i].finish == KVR_GENERATE_LENGTH ? "length"
                                                                 : NULL;
    }
}

/* One prompt after another, each alone (kvr_generate); streams the text of a single
 * prompt, then prompt and decode speeds. */
static int run_local(const struct run_opts *o, struct kvr_gguf *g, const struct kvr_tok *tok,
                     struct job *jobs, uint32_t n_jobs, struct printer *pr)
{
    struct kvr_hparams hp;
    struct kvr_err err = {0};
    if (kvr_hparams_read(&hp, g, &err)) {
        fprintf(stderr, "kvasir run: %s\n", err.msg);
        return 1;
    }
    uint32_t need = 0;
    for (uint32_t i = 0; i < n_jobs; i++)
        need =
            jobs[i].n_ids + jobs[i].max_tokens > need ? jobs[i].n_ids + jobs[i].max_tokens : need;
    uint32_t ctx = o->ctx ? o->ctx : need;
    if (need > ctx) {
        fprintf(stderr, "kvasir run: prompt + %u tokens need a context of %u (have %u)\n",
                o->n_predict, need, ctx);
        return 1;
    }
    struct kvr_generate_config cfg = {.n_ctx = ctx,
                                      .row_width = 512,
                                      .kv_type = o->kv_type,
                                      .n_threads = o->threads,
                                      .ignore_eos = o->ignore_eos};
    struct kvr_generate_stats st;
    struct kvr_generate_seq *seqs = gen_seqs(jobs, n_jobs);
    int rc =
        seqs ? kvr_generate(g, &hp, tok, &cfg, seqs, n_jobs, on_token, pr, &st, &err) : KVR_ENOMEM;
    if (seqs)
        gen_results(jobs, seqs, n_jobs);
    kvr_free(seqs);
    if (rc) {
        fprintf(stderr, "kvasir run: %s\n", err.msg[0] ? err.msg : "out of memory");
        return 1;
    }
    print_end(pr);
    fprintf(stderr, "prompt: %llu tokens in %.1f ms, %.1f tokens/s\n",
            (unsigned long long)st.n_prefill, st.prefill_ns / 1e6,
            st.prefill_ns ? st.n_prefill / (st.prefill_ns / 1e9) : 0.0);
    fprintf(stderr, "decode: %llu tokens in %.1f ms, %.2f tokens/s (%u threads, %s kernels)\n",
            (unsigned long long)st.n_decode, st.decode_ns / 1e6,
            st.decode_ns ? st.n_decode / (st.decode_ns / 1e9) : 0.0, o->threads,
            kvr_kernels_name());
    return 0;
}

/* All prompts at once in one engine (kvr_generate_batched): the throughput baseline a ring
 * is compared against. */
static int run_local_batched(const struct run_opts *o, struct kvr_gguf *g,
                             const struct kvr_tok *tok, struct job *jobs, uint32_t n_jobs)
{
    struct kvr_hparams hp;
    struct kvr_err err = {0};
    if (kvr_hparams_read(&hp, g, &err)) {
        fprintf(stderr, "kvasir run: %s\n", err.msg);
        return 1;
    }
    uint32_t need = 0;
    for (uint32_t i = 0; i < n_jobs; i++)
        if (jobs[i].n_ids + jobs[i].max_tokens > need)
            need = jobs[i].n_ids + jobs[i].max_tokens;
    struct kvr_generate_config cfg = {.n_ctx = o->ctx ? o->ctx : need,
                                      .row_width = o->row_width,
                                      .kv_type = o->kv_type,
                                      .n_threads = o->threads,
                                      .ignore_eos = o->ignore_eos};
    struct kvr_generate_stats st;
    struct kvr_generate_seq *seqs = gen_seqs(jobs, n_jobs);
    int rc = seqs ? kvr_generate_batched(g, &hp, tok, &cfg, seqs, n_jobs, NULL, NULL, &st, &err)
                  : KVR_ENOMEM;
    if (seqs)
        gen_results(jobs, seqs, n_jobs);
    kvr_free(seqs);
    if (rc) {
        fprintf(stderr, "kvasir run: %s\n", err.msg[0] ? err.msg : "out of memory");
        return 1;
    }
    double secs = st.wall_ns / 1e9;
    fprintf(stderr,
            "batched: %u sequences, %llu tokens in %.2f s, %.1f tokens/s, %llu passes "
            "(%u threads)\n",
            n_jobs, (unsigned long long)st.n_tokens, secs, st.n_tokens / secs,
            (unsigned long long)st.n_passes, o->threads);
    return 0;
}

/* ---- through a ring ---------------------------------------------------------------------- */

/* Drain every stream until each has finished; tokens go to the jobs (and the printer).
 * Returns true when some prompt failed. */
static bool collect(struct kvr_bridge *b, struct kvr_gen_stream **streams, struct job *jobs,
                    uint32_t n_jobs, struct printer *pr, uint64_t *n_tokens_out)
{
    uint32_t n_done = 0;
    uint64_t n_tokens = 0, seen = 0;
    bool failed = false;
    while (n_done < n_jobs) {
        /* Sleep until some stream has news, then drain them all without waiting: polling
         * each stream in turn would wake this thread (and take the bridge's lock) a
         * thousand times a second on machines whose cores the stages need. */
        kvr_bridge_wait_any(b, &seen, 100);
        for (uint32_t i = 0; i < n_jobs; i++) {
            struct job *j = &jobs[i];
            if (j->finish)
                continue;
            struct kvr_gen_event ev;
            while (kvr_bridge_next(streams[i], &ev, 0) == 0) {
                if (ev.token >= 0 && j->n_out < j->max_tokens) {
                    j->out[j->n_out++] = ev.token;
                    n_tokens++;
                    print_token(pr, ev.token);
                }
                if (ev.finish != KVR_GEN_FINISH_NONE) {
                    j->finish = ev.finish == KVR_GEN_FINISH_LENGTH ? "length"
                                : ev.finish == KVR_GEN_FINISH_EOS  ? "stop"
                                                                   : "error";
                    if (ev.finish == KVR_GEN_FINISH_ERROR) {
                        fprintf(stderr, "kvasir run: prompt %u failed: %s\n", i, ev.error);
                        failed = true;
                    }
                    n_done++;
                    break;
                }
            }
        }
    }
    *n_tokens_out = n_tokens;
    return failed;
}

/* The ring's summary on stderr: throughput, prefix cache, and each stage's and expert
 * agent's share of time held, starved and blocked. */
static void print_ring_stats(struct kvr_bridge *b, uint32_t n_jobs, uint64_t n_tokens, double secs)
{
    struct kvr_sched_stats st;
    kvr_bridge_stats(b, &st);
    fprintf(stderr, "ring: %u sequences, %llu tokens in %.2f s, %.1f tokens/s, %llu batches\n",
            n_jobs, (unsigned long long)n_tokens, secs, n_tokens / secs,
            (unsigned long long)st.batches);
    fprintf(stderr, "  prefix cache: %llu of %llu prompt tokens reused, %llu computed\n",
            (unsigned long long)st.prefix_hits, (unsigned long long)st.prefix_queries,
            (unsigned long long)st.prompt_tokens);
    for (uint32_t s = 0; s < KVR_DRAFT_SOURCE_COUNT; s++)
        if (st.spec_steps[s])
            fprintf(stderr, "  speculation, %s: %llu drafted tokens on %llu rows, %llu kept\n",
                    kvr_draft_source_name(s), (unsigned long long)st.spec_drafted[s],
                    (unsigned long long)st.spec_steps[s], (unsigned long long)st.spec_accepted[s]);
    for (uint32_t i = 0; i < st.n_stages; i++) {
        double tot =
            (double)(st.stage[i].held_ns + st.stage[i].starved_ns + st.stage[i].blocked_ns);
        if (tot <= 0)
            tot = 1;
        fprintf(stderr, "  stage %u: held %5.1f%%  starved %5.1f%%  blocked %5.1f%%\n", i,
                100.0 * st.stage[i].held_ns / tot, 100.0 * st.stage[i].starved_ns / tot,
                100.0 * st.stage[i].blocked_ns / tot);
    }
    for (uint32_t j = 0; j < st.n_agents; j++) {
        const struct kvr_sched_agent_stats *a = &st.agent[j];
        double tot = (double)(a->held_ns + a->starved_ns + a->blocked_ns);
        if (tot <= 0)
            tot = 1;
        fprintf(stderr,
                "  agent %u: held %5.1f%%  starved %5.1f%%  blocked %5.1f%%  %llu pairs, held "
                "%.3f s\n",
                j, 100.0 * a->held_ns / tot, 100.0 * a->starved_ns / tot,
                100.0 * a->blocked_ns / tot, (unsigned long long)a->pairs, a->held_ns / 1e9);
    }
}

static int run_ring(const struct run_opts *o, const struct kvr_plan *plan,
                    const struct kvr_hparams *hp, struct job *jobs, uint32_t n_jobs,
                    struct printer *pr)
{
    struct kvr_bridge_config cfg = {.plan = plan,
                                    .n_embd = hp->n_embd,
                                    .n_vocab = hp->n_vocab,
                                    .max_waiting = n_jobs + 16,
                                    .no_prefix_cache = o->no_prefix_cache,
                                    .spec = o->spec_mode};
    struct kvr_bridge *b = NULL;
    struct kvr_err err = {0};
    if (kvr_bridge_create(&b, &cfg, &err)) {
        fprintf(stderr, "kvasir run: %s\n", err.msg);
        return 1;
    }
    int rc = 1;
    struct kvr_gen_stream **streams = kvr_calloc(n_jobs, sizeof *streams);
    if (!streams)
        goto out;
    if (!kvr_bridge_wait_up(b, 30000)) {
        fprintf(stderr, "kvasir run: the ring did not come up within 30 s (are the stages "
                        "running?)\n");
        goto out;
    }
    uint64_t t0 = kvr_now_ns();
    for (uint32_t i = 0; i < n_jobs; i++) {
        struct kvr_gen_request req = {.prompt = jobs[i].ids,
                                      .n_prompt = jobs[i].n_ids,
                                      .max_tokens = jobs[i].max_tokens,
                                      .sampling = jobs[i].sp,
                                      .ignore_eos = o->ignore_eos,
                                      .prediction = jobs[i].pred,
                                      .n_prediction = jobs[i].n_pred};
        for (uint32_t k = 0; k < jobs[i].n_pred; k++)
            if ((uint32_t)jobs[i].pred[k] >= hp->n_vocab) {
                fprintf(stderr, "kvasir run: prompt %u: prediction id %d beyond the vocabulary\n",
                        i, jobs[i].pred[k]);
                goto out;
            }
        struct kvr_refusal why;
        if (kvr_bridge_submit(b, &req, &streams[i], &why)) {
            fprintf(stderr, "kvasir run: prompt %u refused: %s\n", i, why.message);
            goto out;
        }
    }
    uint64_t n_tokens = 0;
    bool failed = collect(b, streams, jobs, n_jobs, pr, &n_tokens);
    double secs = (kvr_now_ns() - t0) / 1e9;
    print_end(pr);
    print_ring_stats(b, n_jobs, n_tokens, secs);
    rc = failed ? 1 : 0;
out:
    for (uint32_t i = 0; streams && i < n_jobs; i++)
        kvr_bridge_release(streams[i]);
    kvr_free(streams);
    kvr_bridge_destroy(b);
    return rc;
}

static void print_results(const struct run_opts *o, const struct kvr_tok *tok,
                          const struct job *jobs, uint32_t n_jobs)
{
    for (uint32_t i = 0; i < n_jobs; i++) {
        const struct job *j = &jobs[i];
        if (o->json) {
            json_t *ids = json_array();
            for (uint32_t k = 0; k < j->n_out; k++)
                json_array_append_new(ids, json_integer(j->out[k]));
            json_t *line =
                json_pack("{s:i, s:i, s:o, s:s}", "index", (int)i, "n_prompt", (int)j->n_ids, "ids",
                          ids, "finish", j->finish ? j->finish : "error");
            char *s = json_dumps(line, JSON_COMPACT);
            printf("%s\n", s);
            free(s);
            json_decref(line);
        } else if (o->print_ids) {
            for (uint32_t k = 0; k < j->n_out; k++)
                printf("%s%d", k ? " " : "", j->out[k]);
            printf("\n");
        }
    }
    (void)tok;
}

/* ---- teacher forcing ------------------------------------------------------------------- */

enum { FORCE_MAX_IDS = 1 << 20, FORCE_MAX_FILE = 64 << 20 };

struct id_list {
    int32_t *ids;
    uint32_t n, cap;
};

static int push_id(struct id_list *l, double v)
{
    if (v < 0 || v > INT32_MAX || v != (double)(int64_t)v || l->n >= FORCE_MAX_IDS)
        return -1;
    if (l->n == l->cap) {
        uint32_t cap = l->cap ? 2 * l->cap : 256;
        int32_t *grown = kvr_realloc(l->ids, (size_t)cap * sizeof *grown);
        if (!grown)
            return -1;
        l->ids = grown;
        l->cap = cap;
    }
    l->ids[l->n++] = (int32_t)v;
    return 0;
}

static int push_json_ids(struct id_list *l, json_t *arr, bool steps)
{
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v)
    {
        json_t *id = steps ? json_object_get(v, "id") : v;
        if (!json_is_integer(id) || push_id(l, (double)json_integer_value(id)))
            return -1;
    }
    return 0;
}

/* Read FILE into prompt (refgen's prompt_ids, else empty) and forced ids. */
static int load_forced(const char *path, struct id_list *prompt, struct id_list *forced)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvasir run: cannot open %s\n", path);
        return -1;
    }
    char *buf = kvr_malloc(FORCE_MAX_FILE + 1);
    size_t n = buf ? fread(buf, 1, FORCE_MAX_FILE + 1, f) : 0;
    fclose(f);
    if (!buf || n > FORCE_MAX_FILE) {
        fprintf(stderr, "kvasir run: %s: %s\n", path, buf ? "larger than 64 MB" : "no memory");
        kvr_free(buf);
        return -1;
    }
    buf[n] = 0;
    int rc = 0;
    json_error_t jerr;
    json_t *doc = json_loadb(buf, n, 0, &jerr);
    if (json_is_object(doc)) {
        json_t *p = json_object_get(doc, "prompt_ids"), *st = json_object_get(doc, "steps");
        if (!json_is_array(p) || !json_is_array(st) || push_json_ids(prompt, p, false) ||
            push_json_ids(forced, st, true))
            rc = -1;
    } else if (json_is_array(doc)) {
        rc = push_json_ids(forced, doc, false);
    } else {
        for (char *c = buf, *end; *c;) {
            if (*c == ' ' || *c == ',' || *c == '\n' || *c == '\t' || *c == '\r') {
                c++;
                continue;
            }
            long v = strtol(c, &end, 10);
            if (end == c || push_id(forced, (double)v)) {
                rc = -1;
                break;
            }
            c = end;
        }
    }
    json_decref(doc);
    kvr_free(buf);
    if (rc)
        fprintf(stderr,
                "kvasir run: %s: want refgen's JSON, a JSON array of ids, or ids "
                "separated by spaces or commas\n",
                path);
    return rc;
}

static void print_step(const struct run_opts *o, uint32_t step, int32_t want, const float *lg,
                       uint32_t n_vocab, int32_t *top)
{
    /* top: the n_top best ids, best first (ties to the lower id). */
    uint32_t k = o->n_top < n_vocab ? o->n_top : n_vocab;
    for (uint32_t j = 0; j < k; j++)
        top[j] = -1;
    for (uint32_t i = 0; i < n_vocab; i++) {
        uint32_t j = k;
        while (j > 0 && (top[j - 1] < 0 || lg[i] > lg[top[j - 1]]))
            j--;
        if (j == k)
            continue;
        memmove(top + j + 1, top + j, (k - j - 1) * sizeof *top);
        top[j] = (int32_t)i;
    }
    float margin = k > 1 ? lg[top[0]] - lg[top[1]] : 0.0f;
    if (!o->json) {
        printf("step %u: forced %d argmax %d margin %.6f top", step, want, top[0], (double)margin);
        for (uint32_t j = 0; j < k; j++)
            printf(" %d:%.6f", top[j], (double)lg[top[j]]);
        printf("\n");
        return;
    }
    printf("{\"step\": %u, \"forced\": %d, \"argmax\": %d, \"margin\": %.9g, \"top\": [", step,
           want, top[0], (double)margin);
    for (uint32_t j = 0; j < k; j++)
        printf("%s[%d, %.9g]", j ? ", " : "", top[j], (double)lg[top[j]]);
    printf("]");
    if (step < o->n_logits) {
        printf(", \"logits\": [");
        for (uint32_t i = 0; i < n_vocab; i++)
            printf("%s%.9g", i ? "," : "", (double)lg[i]);
        printf("]");
    }
    printf("}\n");
}

static int run_forced(const struct run_opts *o, struct kvr_gguf *g, const struct kvr_tok *tok)
{
    struct id_list prompt = {0}, forced = {0};
    struct kvr_hparams hp;
    struct kvr_err err = {0};
    struct kvr_engine *e = NULL;
    float *logits = NULL;
    int32_t *top = NULL;
    int rc = 1;
    if (load_forced(o->force_ids, &prompt, &forced))
        goto out;
    if (o->prompt) {
        struct job j = {.prompt = (char *)o->prompt, .max_tokens = 1};
        prompt.n = 0;
        if (tokenize_jobs(tok, &j, 1)) {
            kvr_free(j.ids);
            kvr_free(j.out);
            goto out;
        }
        int failed = 0;
        for (uint32_t i = 0; i < j.n_ids && !failed; i++)
            failed = push_id(&prompt, j.ids[i]);
        kvr_free(j.ids);
        kvr_free(j.out);
        if (failed) {
            fprintf(stderr, "kvasir run: out of memory\n");
            goto out;
        }
    } else if (prompt.n == 0 && forced.n > 0) {
        if (push_id(&prompt, forced.ids[0]))
            goto out;
        memmove(forced.ids, forced.ids + 1, (forced.n - 1) * sizeof *forced.ids);
        forced.n--;
    }
    if (prompt.n == 0 || forced.n == 0) {
        fprintf(stderr, "kvasir run: %s: need a prompt and at least one forced id\n", o->force_ids);
        goto out;
    }
    if (kvr_hparams_read(&hp, g, &err)) {
        fprintf(stderr, "kvasir run: %s\n", err.msg);
        goto out;
    }
    struct kvr_engine_config cfg = {.first_layer = 0,
                                    .last_layer = hp.n_layer - 1,
                                    .max_rows = 512,
                                    .max_seqs = 1,
                                    .n_ctx = o->ctx ? o->ctx : prompt.n + forced.n,
                                    .kv_block_tokens = 16,
                                    .kv_type = o->kv_type,
                                    .n_threads = o->threads};
    logits = kvr_malloc((size_t)hp.n_vocab * sizeof *logits);
    top = kvr_malloc((size_t)o->n_top * sizeof *top);
    if (!logits || !top || kvr_engine_create(&e, g, &cfg, &err)) {
        fprintf(stderr, "kvasir run: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto out;
    }
    uint32_t same = 0;
    for (uint32_t pos = 0; pos < prompt.n;) {
        uint32_t n = prompt.n - pos < cfg.max_rows ? prompt.n - pos : cfg.max_rows;
        bool last = pos + n == prompt.n;
        struct kvr_seg seg = {
            0, pos, n, KVR_SEG_PREFILL | (last ? KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN : 0)};
        if (kvr_engine_forward(e, &seg, 1, prompt.ids + pos, NULL, logits, &err))
            goto fail;
        pos += n;
    }
    for (uint32_t k = 0; k < forced.n; k++) {
        print_step(o, k, forced.ids[k], logits, hp.n_vocab, top);
        same += top[0] == forced.ids[k];
        if (k + 1 == forced.n)
            break;
        struct kvr_seg seg = {0, prompt.n + k, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
        if (kvr_engine_forward(e, &seg, 1, &forced.ids[k], NULL, logits, &err))
            goto fail;
    }
    fprintf(stderr, "forced: %u prompt ids, %u steps, argmax = forced id at %u\n", prompt.n,
            forced.n, same);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "kvasir run: %s\n", err.msg);
out:
    kvr_engine_destroy(e);
    kvr_free(logits);
    kvr_free(top);
    kvr_free(prompt.ids);
    kvr_free(forced.ids);
    return rc;
}

int kvr_cmd_run(int argc, char **argv)
{
    struct run_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    kvr_log_set_tag("run");
    struct kvr_err err = {0};
    struct kvr_plan *plan = NULL;
    char model_path[KVR_PLAN_PATH_BYTES];
    snprintf(model_path, sizeof model_path, "%s", o.model ? o.model : "");
    if (o.plan) {
        plan = kvr_malloc(sizeof *plan);
        if (!plan || kvr_plan_load(plan, o.plan, &err) || kvr_plan_validate(plan, 0, &err) ||
            kvr_plan_path(plan, plan->model_path, model_path, sizeof model_path, &err)) {
            fprintf(stderr, "kvasir run: plan %s: %s\n", o.plan, err.msg);
            kvr_free(plan);
            return 1;
        }
    }
    struct kvr_gguf *g = NULL;
    struct kvr_tok *tok = NULL;
    struct job *jobs = NULL;
    uint32_t n_jobs = 0;
    rc = 1;
    if (kvr_gguf_open(&g, model_path, &err)) {
        fprintf(stderr, "kvasir run: %s: %s\n", model_path, err.msg);
        goto out;
    }
    if (kvr_tok_create(&tok, g, &err)) {
        fprintf(stderr, "kvasir run: %s: vocabulary: %s\n", model_path, err.msg);
        goto out;
    }
    if (o.force_ids) {
        kvr_cli_load_weights(g);
        rc = run_forced(&o, g, tok);
        goto out;
    }
    if (load_jobs(&o, &jobs, &n_jobs) || (o.chat && chat_jobs(&o, g, tok, jobs, n_jobs)) ||
        tokenize_jobs(tok, jobs, n_jobs))
        goto out;
    if (!plan)
        kvr_cli_load_weights(g);
    struct printer pr = {.tok = tok, .on = n_jobs == 1 && !o.quiet && !o.json};
    kvr_detok_init(&pr.dt, false, false);
    if (pr.on) {
        fputs(jobs[0].prompt, stdout);
        fflush(stdout);
    }
    if (plan) {
        struct kvr_hparams hp;
        if (kvr_hparams_read(&hp, g, &err) || kvr_plan_validate(plan, hp.n_layer, &err)) {
            fprintf(stderr, "kvasir run: %s\n", err.msg);
            goto out;
        }
        rc = run_ring(&o, plan, &hp, jobs, n_jobs, &pr);
    } else if (o.batched) {
        rc = run_local_batched(&o, g, tok, jobs, n_jobs);
    } else {
        rc = run_local(&o, g, tok, jobs, n_jobs, &pr);
    }
    if (rc == 0)
        print_results(&o, tok, jobs, n_jobs);
out:
    free_jobs(jobs, n_jobs);
    kvr_tok_destroy(tok);
    kvr_gguf_close(g);
    if (plan) {
        kvr_plan_wipe(plan);
        kvr_free(plan);
    }
    return rc;
}
