/* tokenize.c - `kvasir tokenize`: the token ids of a text, with the model's own tokenizer.
 *
 *   kvasir tokenize -m MODEL [--ids] [--no-bos] [--special] TEXT
 *   kvasir tokenize -m MODEL [...] -f FILE        the text of a file ("-": standard input)
 *   kvasir tokenize -m MODEL [...] --stdin        the text of standard input
 *   kvasir tokenize -m MODEL [...] --chat FILE.json   a conversation, rendered
 *   kvasir tokenize --list-pre                     the tokenizer.ggml.pre names known
 *
 * Prints one line per token, "ID -> 'TEXT'" (what the token decodes to, control tokens
 * shown, control bytes and bytes that are not UTF-8 escaped), or with --ids the ids alone as a list
 * in the form llama.cpp's llama-tokenize --ids prints ("[1, 2, 3]"). BOS (and EOS) are added when
 * the model's vocabulary asks for them, unless --no-bos. Special tokens written in the text
 * (<|eot_id|>, <|im_start|>, ...) are recognised only with --special; without it they are plain
 * text. The text is used byte for byte (no escapes, no newline added).
 *
 * --chat FILE.json takes a conversation ({"messages": [...]} as a chat request has it, or
 * the bare array) and prints the prompt /v1/chat/completions would send, rendered with
 * the model's chat template (or --chat-template NAME|FILE); with --ids, its token ids as
 * the server counts them (special tokens recognised, one BOS). */
#include "cli/cmd.h"

#include "bridge/chat.h"
#include "bridge/openai.h"
#include "cli/common.h"
#include "core/alloc.h"
#include "core/utf8.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_TEXT_BYTES ((size_t)64 << 20)

struct tok_opts {
    const char *model;
    const char *text;      /* TEXT argument */
    const char *text_file; /* -f FILE, "-" for standard input */
    const char *chat_file; /* --chat FILE.json */
    const char *chat_template;
    bool ids, no_bos, special, list_pre;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvasir tokenize -m MODEL [options] (TEXT | -f FILE | --stdin)\n"
            "  -m, --model FILE       GGUF file with a tokenizer (a vocabulary-only file will do)\n"
            "  -p, --prompt TEXT      the text (same as a TEXT argument)\n"
            "  -f, --file FILE        read the text from FILE (\"-\": standard input)\n"
            "      --stdin            read the text from standard input\n"
            "      --ids              print only the ids, as [1, 2, 3]\n"
            "      --no-bos           add no BOS/EOS even where the model wants them\n"
            "      --special          recognise special tokens written in the text\n"
            "      --chat FILE.json   print the chat prompt of a conversation ({\"messages\":\n"
            "                         [...]} or the array), rendered with the model's template\n"
            "      --chat-template NAME|FILE  a built-in or Jinja file instead of the model's\n"
            "  -- TEXT                a text that starts with '-'\n"
            "      --list-pre         list the BPE pre-tokenizers (tokenizer.ggml.pre) known\n"
            "The text is taken byte for byte; at most %zu MiB.\n",
            MAX_TEXT_BYTES >> 20);
}

/* 0 to go on, 1 after --help, 2 on a usage error (printed). */
static int parse_args(int argc, char **argv, struct tok_opts *o)
{
    memset(o, 0, sizeof *o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes_value = !strcmp(a, "-m") || !strcmp(a, "--model") || !strcmp(a, "-p") ||
                           !strcmp(a, "--prompt") || !strcmp(a, "-f") || !strcmp(a, "--file") ||
                           !strcmp(a, "--chat") || !strcmp(a, "--chat-template");
        if (takes_value && !v) {
            fprintf(stderr, "kvasir tokenize: %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            o->model = v;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            o->text = v;
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            o->text_file = v;
        } else if (!strcmp(a, "--chat")) {
            o->chat_file = v;
        } else if (!strcmp(a, "--chat-template")) {
            o->chat_template = v;
        } else if (!strcmp(a, "--stdin")) {
            o->text_file = "-";
        } else if (!strcmp(a, "--ids")) {
            o->ids = true;
        } else if (!strcmp(a, "--no-bos")) {
            o->no_bos = true;
        } else if (!strcmp(a, "--special")) {
            o->special = true;
        } else if (!strcmp(a, "--list-pre")) {
            o->list_pre = true;
        } else if (!strcmp(a, "--") && i + 1 < argc && !o->text) {
            o->text = argv[++i]; /* a text that starts with '-' */
        } else if (a[0] == '-' && a[1] != 0) {
            kvr_cli_unknown_usage("tokenize", a, usage);
            return 2;
        } else if (!o->text) {
            o->text = a;
        } else {
            fprintf(stderr, "kvasir tokenize: more than one text given ('%s')\n", a);
            return 2;
        }
        if (takes_value)
            i++;
    }
    if (o->list_pre)
        return 0;
    if (!o->model) {
        fprintf(stderr, "kvasir tokenize: -m MODEL is required\n");
        return 2;
    }
    if (!!o->text + !!o->text_file + !!o->chat_file != 1) {
        fprintf(stderr, "kvasir tokenize: give the text as TEXT, -f FILE, --stdin or --chat "
                        "FILE.json (one)\n");
        return 2;
    }
    return 0;
}

/* The whole of a file or of standard input, malloc'd; NULL after printing why. */
static char *read_text(const char *path, size_t *len)
{
    bool is_stdin = !strcmp(path, "-");
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) {
        perror(path);
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n == cap) {
            char *bigger = cap < MAX_TEXT_BYTES + 1 ? realloc(buf, 2 * cap) : NULL;
            if (!bigger) {
                fprintf(stderr, "kvasir tokenize: %s: more than %zu MiB of text\n", path,
                        MAX_TEXT_BYTES >> 20);
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
        size_t k = fread(buf + n, 1, cap - n, f);
        n += k;
        if (k == 0)
            break;
    }
    if (buf && ferror(f)) {
        perror(path);
        free(buf);
        buf = NULL;
    }
    if (buf && n > MAX_TEXT_BYTES) {
        fprintf(stderr, "kvasir tokenize: %s: more than %zu MiB of text\n", path,
                MAX_TEXT_BYTES >> 20);
        free(buf);
        buf = NULL;
    }
    if (!is_stdin)
        fclose(f);
    *len = n;
    return buf;
}

/* A token's text between quotes: printable ASCII and well-formed UTF-8 as they are, control
 * bytes and bytes that are not (part of) a UTF-8 character escaped. */
static void print_piece(const char *text, size_t n)
{
    const unsigned char *p = (const unsigned char *)text;
    putchar('\'');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        uint32_t cp;
        size_t k = c >= 0x80 ? kvr_utf8_decode(text + i, n - i, &cp, KVR_UTF8_STRICT) : 0;
        if (k > 0) {
            fwrite(p + i, 1, k, stdout);
            i += k - 1;
        } else if (c == '\n') {
            fputs("\\n", stdout);
        } else if (c == '\t') {
            fputs("\\t", stdout);
        } else if (c == '\r') {
            fputs("\\r", stdout);
        } else if (c == '\\' || c == '\'') {
            printf("\\%c", c);
        } else if (c < 0x20 || c >= 0x7F) {
            printf("\\x%02x", c);
        } else {
            putchar(c);
        }
    }
    putchar('\'');
}

/* The BOS token's text (points into the tokenizer), or NULL. */
static const char *bos_text(const struct kvr_tok *tok)
{
    static char buf[256];
    const char *p;
    size_t n;
    int32_t id = kvr_tok_bos(tok);
    if (id < 0 || kvr_tok_decode_piece(tok, id, true, &p, &n) != 0 || n >= sizeof buf)
        return NULL;
    memcpy(buf, p, n);
    buf[n] = 0;
    return buf;
}

/* --chat: the conversation of FILE.json rendered as the server renders it (*out is
 * kvr_malloc'd). 0, or -1 after printing why. */
static int render_chat(const struct tok_opts *o, const struct kvr_gguf *g,
                       const struct kvr_tok *tok, char **out, size_t *out_len)
{
    size_t len = 0;
    char *src = NULL, *file = read_text(o->chat_file, &len);
    if (!file)
        return -1;
    int rc = -1;
    struct kvr_chat *chat = NULL;
    struct kvr_openai_req r;
    struct kvr_openai_error e;
    memset(&r, 0, sizeof r);
    /* A bare array is the messages themselves. */
    size_t i = 0;
    while (i < len && (file[i] == ' ' || file[i] == '\n' || file[i] == '\t' || file[i] == '\r'))
        i++;
    char *body = file;
    size_t body_len = len;
    char *wrapped = NULL;
    if (i < len && file[i] == '[') {
        wrapped = malloc(len + 16);
        if (!wrapped)
            goto done;
        body_len = (size_t)sprintf(wrapped, "{\"messages\": ") + len;
        memcpy(wrapped + body_len - len, file, len);
        wrapped[body_len++] = '}';
        body = wrapped;
    }
    struct kvr_openai_limits lim = {.n_ctx = UINT32_MAX, .n_vocab = (uint32_t)kvr_tok_n_vocab(tok)};
    if (kvr_openai_parse(&r, KVR_OPENAI_CHAT, body, body_len, &lim, &e)) {
        fprintf(stderr, "kvasir tokenize: %s: %s\n", o->chat_file, e.message);
        goto done;
    }
    struct kvr_chat_config cc = {.bos_token = bos_text(tok)};
    char eos[256] = "";
    const char *p;
    size_t n;
    if (kvr_tok_eos(tok) >= 0 && kvr_tok_decode_piece(tok, kvr_tok_eos(tok), true, &p, &n) == 0 &&
        n < sizeof eos) {
        memcpy(eos, p, n);
        eos[n] = 0;
        cc.eos_token = eos;
    }
    if (o->chat_template) {
        if (kvr_cli_chat_template(o->chat_template, &cc.builtin, &src, &cc.jinja_len))
            goto done;
        cc.jinja = src;
    } else {
        struct kvr_gguf_str t = {0};
        if (kvr_gguf_get_str(g, "tokenizer.chat_template", &t, NULL) == 0) {
            cc.jinja = t.ptr;
            cc.jinja_len = (size_t)t.len;
        }
    }
    struct kvr_err err = {0};
    if (kvr_chat_create(&chat, &cc, &err)) {
        fprintf(stderr, "kvasir tokenize: chat template: %s\n", err.msg);
        goto done;
    }
    if (kvr_chat_source(chat) == KVR_CHAT_SOURCE_PLAIN)
        fprintf(stderr, "kvasir tokenize: the model has no chat template; plain \"role: "
                        "content\" lines\n");
    time_t now_s = time(NULL);
    struct tm now;
    if (kvr_chat_apply(chat, r.msgs, r.n_msgs, true, localtime_r(&now_s, &now), out, out_len,
                       &err)) {
        fprintf(stderr, "kvasir tokenize: the chat template failed: %s\n", err.msg);
        goto done;
    }
    rc = 0;
done:
    kvr_chat_destroy(chat);
    kvr_openai_req_fini(&r);
    kvr_free(src);
    free(wrapped);
    free(file);
    return rc;
}

int kvr_cmd_tokenize(int argc, char **argv)
{
    struct tok_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : 2;
    if (o.list_pre) {
        for (size_t i = 0; kvr_tok_pre_name(i); i++)
            puts(kvr_tok_pre_name(i));
        return 0;
    }

    int status = 1;
    struct kvr_gguf *g = NULL;
    struct kvr_tok *tok = NULL;
    struct kvr_tok_scratch *s = NULL;
    char *owned = NULL, *rendered = NULL;
    int32_t *ids = NULL;
    struct kvr_err err = {0};

    const char *text = o.text;
    size_t len = text ? strlen(text) : 0;
    if (o.text_file) {
        owned = read_text(o.text_file, &len);
        if (!owned)
            goto out;
        text = owned;
    }
    if (len > MAX_TEXT_BYTES) {
        fprintf(stderr, "kvasir tokenize: more than %zu MiB of text\n", MAX_TEXT_BYTES >> 20);
        goto out;
    }
    if (kvr_gguf_open(&g, o.model, &err) || kvr_tok_create(&tok, g, &err)) {
        fprintf(stderr, "kvasir tokenize: %s: %s\n", o.model, err.msg);
        goto out;
    }
    if (o.chat_file) {
        if (render_chat(&o, g, tok, &rendered, &len))
            goto out;
        size_t skip =
            o.no_bos ? 0 : kvr_chat_bos_skip(rendered, len, bos_text(tok), kvr_tok_add_bos(tok));
        if (!o.ids) {
            status = fwrite(rendered, 1, len, stdout) == len && fflush(stdout) == 0 ? 0 : 1;
            goto out;
        }
        text = rendered + skip;
        len -= skip;
        o.special = true;
    }
    kvr_gguf_close(g);
    g = NULL;
    /* A token covers at least one byte of text, except SentencePiece's leading space; BOS
     * and EOS come on top. */
    size_t max_ids = len + 4;
    ids = kvr_malloc(max_ids * sizeof *ids);
    if (!ids || kvr_tok_scratch_create(&s, tok, len) != 0) {
        fprintf(stderr, "kvasir tokenize: out of memory for %zu bytes of text\n", len);
        goto out;
    }
    int n = kvr_tok_encode(tok, s, text, len, !o.no_bos, o.special, ids, max_ids);
    if (n < 0) {
        fprintf(stderr, "kvasir tokenize: the text cannot be encoded (%s)\n",
                n == KVR_EINVAL ? "a byte the vocabulary cannot represent" : "too many tokens");
        goto out;
    }
    if (o.ids) {
        putchar('[');
        for (int i = 0; i < n; i++)
            printf(i ? ", %d" : "%d", (int)ids[i]);
        puts("]");
    } else {
        for (int i = 0; i < n; i++) {
            const char *p;
            size_t plen;
            kvr_tok_decode_piece(tok, ids[i], true, &p, &plen);
            printf("%6d -> ", (int)ids[i]);
            print_piece(p, plen);
            putchar('\n');
        }
    }
    status = fflush(stdout) == 0 ? 0 : 1;
out:
    kvr_free(ids);
    kvr_tok_scratch_destroy(s);
    kvr_tok_destroy(tok);
    kvr_gguf_close(g);
    free(owned);
    kvr_free(rendered);
    return status;
}
