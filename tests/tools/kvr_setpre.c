/* kvr_setpre.c - copy a vocabulary-only GGUF with another tokenizer.ggml.pre, for the
 * pre-tokenizer comparison with llama.cpp (tests/integration/tokenize_peer.sh).
 *
 *   kvr_setpre IN.gguf OUT.gguf NAME [--drop KEY]...
 *
 * Every key/value pair of IN is copied in order, except tokenizer.ggml.pre (written with
 * NAME in its place) and each KEY given with --drop. IN must have no tensors. Exit status 0,
 * 1 on failure (the reason on stderr), 2 usage. */
#include "model/gguf.h"
#include "model/gguf_write.h"

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    if (argc < 4 || (argc - 4) % 2 != 0) {
        fprintf(stderr, "usage: kvr_setpre IN.gguf OUT.gguf NAME [--drop KEY]...\n");
        return 2;
    }
    const char *in = argv[1], *out = argv[2], *name = argv[3];
    for (int i = 4; i < argc; i += 2) {
        if (strcmp(argv[i], "--drop") != 0) {
            fprintf(stderr, "kvr_setpre: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    struct kvr_err err = {0};
    struct kvr_gguf *g = NULL;
    if (kvr_gguf_open(&g, in, &err)) {
        fprintf(stderr, "kvr_setpre: %s: %s\n", in, err.msg);
        return 1;
    }
    int status = 1;
    FILE *f = NULL;
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    if (!w) {
        fprintf(stderr, "kvr_setpre: out of memory\n");
        goto out;
    }
    if (kvr_gguf_n_tensors(g) != 0) {
        fprintf(stderr, "kvr_setpre: %s has tensors (a vocabulary-only file is expected)\n", in);
        goto out;
    }
    bool wrote_pre = false;
    for (int64_t i = 0; i < kvr_gguf_n_kv(g); i++) {
        const char *key = kvr_gguf_kv_key(g, i);
        bool drop = false;
        for (int k = 4; k < argc; k += 2)
            drop |= !strcmp(key, argv[k + 1]);
        if (!strcmp(key, "tokenizer.ggml.pre")) {
            kvr_gguf_writer_add_str(w, key, name);
            wrote_pre = true;
        } else if (!drop) {
            kvr_gguf_writer_copy_kv(w, g, i);
        }
    }
    if (!wrote_pre)
        kvr_gguf_writer_add_str(w, "tokenizer.ggml.pre", name);
    f = fopen(out, "wb");
    if (!f) {
        perror(out);
        goto out;
    }
    if (kvr_gguf_writer_write(w, f, &err)) {
        fprintf(stderr, "kvr_setpre: %s: %s\n", out, err.msg);
        goto out;
    }
    status = 0;
out:
    if (f && fclose(f) != 0) {
        perror(out);
        status = 1;
    }
    kvr_gguf_writer_destroy(w);
    kvr_gguf_close(g);
    return status;
}
