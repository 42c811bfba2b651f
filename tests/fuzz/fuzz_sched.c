/* fuzz_sched.c - random event sequences through the bridge's scheduler (sched.h), with the
 * invariants of tests/support/fake_ring.h checked after every event: KV accounting
 * balances, a sequence wants a token from at most one in-flight batch, FREE precedes any
 * re-OPEN of a slot (and segments run only on open slots), no stream event after a
 * stream's end, every request detached by the end. A broken invariant aborts.
 *
 * Input: byte 0 picks the plan (micro-batches 1-4, row width 4-64, slots 1-8, KV blocks,
 * admission on or off); then each byte is an event (low 4 bits) with arguments taken from
 * the bytes after it:
 *   0-1 submit (prompt length, max_tokens, sampling and budget bits)   2 cancel a request
 *   3-5 the oldest batch comes back   6 it is lost   7 RESET (a link, or a batch id)
 *   8 link down   9 link up   10-11 time passes (up to 16 s)   12 drain the ring
 * Shared with nothing else; tests/fuzz/corpus/fuzz_sched/ holds seeds. */
#include "../support/fake_ring.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static struct sh harness;

struct input {
    const uint8_t *p;
    size_t n, at;
};

static uint8_t next_byte(struct input *in)
{
    return in->at < in->n ? in->p[in->at++] : 0;
}

static void check(struct sh *h)
{
    if (h->fail[0]) {
        fprintf(stderr, "fuzz_sched: invariant broken: %s\n", h->fail);
        abort();
    }
}

/* The oldest batch comes back. A result the scheduler refuses right after a batch was
 * lost is what the shell answers by dropping its links; any other refusal is a bug. */
static void deliver(struct sh *h, bool *dropped)
{
    if (h->links_up && sh_deliver(h) == KVR_EPROTO) {
        if (!*dropped)
            sh_failf(h, "a result in order was refused");
        sh_link_down(h, "result out of order");
        *dropped = false;
    }
    sh_pump(h);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct input in = {data, size, 0};
    struct sh *h = &harness;
    uint8_t shape = next_byte(&in);
    uint32_t mb = 1 + (shape & 3), rows = 4u << ((shape >> 2) & 3), seqs = 1 + ((shape >> 4) & 7);
    uint32_t blocks = 4 + ((shape >> 5) & 7) * 6;
    if (sh_init(h, mb, rows, seqs, blocks, (shape & 0x80) != 0))
        return 0;
    h->shared_prefix = next_byte(&in) % 100; /* prompts share this prefix: cache hits */
    uint32_t n_req = 0;
    bool dropped = false; /* a batch was lost since the links last went down */
    while (in.at < in.n && !h->fail[0]) {
        uint8_t op = next_byte(&in);
        switch (op & 15) {
        case 0:
        case 1: {
            if (n_req >= SH_MAX_REQS)
                break;
            uint8_t a = next_byte(&in), b = next_byte(&in), c = next_byte(&in);
            struct kvr_refusal why;
            /* Some wait for the previous request's prompt, as the choices of n > 1 do. */
            h->prompt_of = (a & 0x80) && n_req ? h->reqs[n_req - 1].r.id : 0;
            sh_submit(h, n_req++, 1 + a % 120, 1 + b % SH_MAX_GEN, (c & 1) ? 0.7f : 0,
                      (c & 2) ? 1.2f : 1.0f, (c & 4) ? 5u + (c >> 3) * 20u : 0,
                      (c & 8) ? 50u + (c >> 4) * 400u : 0, &why);
            break;
        }
        case 2:
            if (n_req)
                sh_cancel(h, next_byte(&in) % n_req);
            break;
        case 3:
        case 4:
        case 5:
            deliver(h, &dropped);
            break;
        case 6:
            dropped = dropped || h->n_ring > 0;
            sh_drop(h);
            break;
        case 7: {
            uint8_t a = next_byte(&in);
            uint64_t id = (a & 1) ? KVR_WIRE_RESET_LINK
                                  : (h->n_ring ? h->ring[h->ring_head].id : 0) + (a >> 6);
            if (!h->links_up)
                break;
            kvr_sched_reset(h->s, 1, id, h->now);
            memset(h->open, 0, sizeof h->open);
            sh_check(h);
            sh_pump(h);
            break;
        }
        case 8:
            sh_link_down(h, "fuzz");
            dropped = false;
            break;
        case 9:
            sh_link_up(h);
            break;
        case 10:
        case 11:
            sh_tick(h, (uint64_t)next_byte(&in) * 64 * SH_MS);
            break;
        case 12:
            for (uint32_t k = 0; k < 64 && h->n_ring > 0 && !h->fail[0]; k++)
                deliver(h, &dropped);
            break;
        default:
            break;
        }
        check(h);
    }
    sh_fini(h);
    check(h);
    return 0;
}
