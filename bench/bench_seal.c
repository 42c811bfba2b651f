/* bench_seal.c - what sealing costs a frame (src/ring/seal.h): the time to seal a frame as
 * the link sends it (three pieces: header and records, payload, timing records) and to
 * open it in place, against a plain memcpy of the same bytes, for the frame sizes a ring
 * sends (decode batches of a few rows up to a full row width of f32 boundary rows).
 * Each figure is the median of --reps repeats (default 9) of enough calls to take ~20 ms.
 *   bench_seal [--reps N] [--embd 256,2048,4096] [--rows 1,32,64]
 * One thread: a link's sending and receiving each run on their own thread. */
#include "core/alloc.h"
#include "core/clock.h"
#include "ring/seal.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIST 16

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int parse_list(const char *s, unsigned *out)
{
    int n = 0;
    while (*s && n < MAX_LIST) {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s || v == 0)
            return -1;
        out[n++] = (unsigned)v;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

int main(int argc, char **argv)
{
    unsigned embd[MAX_LIST] = {256, 2048, 4096}, rows[MAX_LIST] = {1, 32, 64};
    int n_embd = 3, n_rows = 3, reps = 9;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--embd"))
            n_embd = parse_list(argv[i + 1], embd);
        else if (!strcmp(argv[i], "--rows"))
            n_rows = parse_list(argv[i + 1], rows);
        else
            n_embd = -1;
    }
    if (n_embd < 1 || n_rows < 1 || reps < 1 || reps > 99) {
        fprintf(stderr, "usage: bench_seal [--reps N] [--embd A,B] [--rows A,B]\n");
        return 2;
    }
    if (sodium_init() < 0) /* picks libsodium's fastest ChaCha20 and Poly1305 for this CPU */
        return 1;
    static const uint8_t key[KVR_SEAL_KEY_BYTES] = {7};
    printf("%6s %5s %10s %12s %12s %12s %10s\n", "n_embd", "rows", "frame B", "memcpy us",
           "seal us", "open us", "seal GB/s");
    for (int e = 0; e < n_embd; e++)
        for (int r = 0; r < n_rows; r++) {
            size_t records = 40 + 48 + (size_t)rows[r] * 16, timings = 2 * 32;
            size_t payload = (size_t)rows[r] * embd[e] * 4;
            size_t frame = records + payload + timings;
            uint8_t *src = kvr_aligned_alloc(64, (frame + 63) / 64 * 64);
            uint8_t *dst = kvr_aligned_alloc(64, (frame + 127) / 64 * 64);
            if (!src || !dst)
                return 1;
            for (size_t i = 0; i < frame; i++)
                src[i] = (uint8_t)(i * 31 + 7);
            struct iovec iov[3] = {
                {src, records}, {src + records, payload}, {src + records + payload, timings}};
            int calls = (int)(20e6 / (frame * 1.0 + 2000));
            if (calls < 4)
                calls = 4;
            double t_copy[99], t_seal[99], t_open[99];
            for (int k = 0; k < reps; k++) {
                uint64_t t0 = kvr_now_ns();
                for (int c = 0; c < calls; c++) {
                    memcpy(dst, src, frame);
                    __asm__ volatile("" : : "r"(dst) : "memory");
                }
                uint64_t t1 = kvr_now_ns();
                struct kvr_seal tx, rx;
                kvr_seal_init(&tx, key);
                kvr_seal_init(&rx, key);
                double open_ns = 0;
                for (int c = 0; c < calls; c++) {
                    size_t n = 0;
                    if (kvr_seal_frame(&tx, iov, 3, frame, dst, kvr_seal_frame_bytes(frame), &n,
                                       NULL))
                        return 1;
                }
                uint64_t t2 = kvr_now_ns();
                /* Opening: one fresh sealed frame per call (a frame opens once). */
                for (int c = 0; c < calls && c < 64; c++) {
                    struct kvr_seal tx2;
                    size_t n = 0;
                    kvr_seal_init(&tx2, key);
                    tx2.next = rx.next;
                    kvr_seal_frame(&tx2, iov, 3, frame, dst, kvr_seal_frame_bytes(frame), &n, NULL);
                    uint64_t a = kvr_now_ns();
                    if (kvr_seal_open_header(&rx, dst, NULL) ||
                        kvr_seal_open_body(&rx, dst + 56, frame - 40, NULL))
                        return 1;
                    open_ns += (double)(kvr_now_ns() - a);
                }
                int n_open = calls < 64 ? calls : 64;
                t_copy[k] = (double)(t1 - t0) / calls / 1e3;
                t_seal[k] = (double)(t2 - t1) / calls / 1e3;
                t_open[k] = open_ns / n_open / 1e3;
            }
            qsort(t_copy, (size_t)reps, sizeof t_copy[0], cmp_double);
            qsort(t_seal, (size_t)reps, sizeof t_seal[0], cmp_double);
            qsort(t_open, (size_t)reps, sizeof t_open[0], cmp_double);
            double s = t_seal[reps / 2];
            printf("%6u %5u %10zu %12.2f %12.2f %12.2f %10.2f\n", embd[e], rows[r], frame,
                   t_copy[reps / 2], s, t_open[reps / 2], (double)frame / (s * 1e3));
            kvr_free(src);
            kvr_free(dst);
        }
    return 0;
}
