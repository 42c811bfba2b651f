/* kvr_rogue.c - a misbehaving ring peer for the integration tests (tests/integration/
 * ring_reject.sh). It plays stage I of a plan: connects to that stage's downstream (stage
 * I+1, or the bridge when I is the tail), runs the real handshake with the plan and secret
 * it was given, and then sends what it is told to:
 *
 *   none        nothing: hold the authenticated link for --hold-ms, then close
 *   oversized   a BATCH header that claims row_width + 1 rows (a frame longer than the plan
 *               allows; its checksum and section sizes are right, so only the row limit
 *               is broken), then as much of its body as the receiver takes; then wait for
 *               the receiver to close the link
 *   truncated   a well-formed BATCH of one prefill row, cut after the header and half its
 *               body, then close
 *   flipped     the same BATCH whole, with one byte in the middle of its body flipped after
 *               it was sealed (as an attacker on the path would); then wait for the
 *               receiver to close the link
 *
 * On a sealed link (the plan's "encrypt", the default) every frame is sealed with the
 * link's session key as a real sender's would be (seal.h), so the receiver reaches the rule
 * each case breaks: the row limit, the cut, the authentication of the altered body.
 *
 * Exit status: 0 done as asked (for oversized and flipped: the receiver closed the link
 * within --wait-ms), 3 the handshake was refused (the reason is printed), 4 the receiver
 * kept the link open after an oversized or flipped frame, 1 any other failure, 2 usage. One line
 * per step on stdout, so a test can read what happened.
 *
 * It uses the ring library exactly as a stage does (plan, link, handshake, codec), so a
 * rogue with the right plan and secret is indistinguishable from a real stage until it
 * sends a frame. */
#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "ring/credit.h"
#include "ring/net.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum send_kind { SEND_NONE, SEND_OVERSIZED, SEND_TRUNCATED, SEND_FLIPPED };

struct opts {
    const char *plan_path;
    uint32_t as;
    enum send_kind send;
    int hold_ms, wait_ms;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvr_rogue --plan PLAN --as I [--send none|oversized|truncated|flipped]\n"
               "                 [--hold-ms N] [--wait-ms N]\n"
               "  Connect to the downstream of stage I of PLAN, handshake as stage I, then\n"
               "  misbehave as told (see the top of tests/tools/kvr_rogue.c).\n");
}

static int parse(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.send = SEND_NONE, .hold_ms = 200, .wait_ms = 5000};
    bool have_as = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            usage(stderr);
            return 2;
        }
        i++;
        if (!strcmp(a, "--plan")) {
            o->plan_path = v;
        } else if (!strcmp(a, "--as")) {
            o->as = (uint32_t)strtoul(v, NULL, 10);
            have_as = true;
        } else if (!strcmp(a, "--send")) {
            if (!strcmp(v, "none"))
                o->send = SEND_NONE;
            else if (!strcmp(v, "oversized"))
                o->send = SEND_OVERSIZED;
            else if (!strcmp(v, "truncated"))
                o->send = SEND_TRUNCATED;
            else if (!strcmp(v, "flipped"))
                o->send = SEND_FLIPPED;
            else {
                usage(stderr);
                return 2;
            }
        } else if (!strcmp(a, "--hold-ms")) {
            o->hold_ms = atoi(v);
        } else if (!strcmp(a, "--wait-ms")) {
            o->wait_ms = atoi(v);
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (!o->plan_path || !have_as) {
        usage(stderr);
        return 2;
    }
    return 0;
}

/* Send raw bytes, ignoring a receiver that has already closed: the rogue only cares that
 * it tried. Returns the bytes that went out. */
static size_t send_raw(int fd, const void *p, size_t n)
{
    size_t done = 0;
    while (done < n) {
        ssize_t w = send(fd, (const uint8_t *)p + done, n - done, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        done += (size_t)w;
    }
    return done;
}

/* Wait until the receiver closes the connection (EOF or reset); credit bytes that arrive
 * meanwhile are read and ignored. Returns the milliseconds it took, or -1 at the timeout. */
static int wait_closed(int fd, int timeout_ms)
{
    uint64_t t0 = kvr_now_ns(), end = t0 + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = kvr_now_ns();
        if (now >= end)
            return -1;
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, (int)((end - now) / 1000000ull) + 1);
        if (r < 0 && errno != EINTR)
            return -1;
        if (r <= 0)
            continue;
        uint8_t buf[256];
        ssize_t got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR))
            return (int)((kvr_now_ns() - t0) / 1000000ull);
    }
}

/* The header of a BATCH that claims row_width + 1 rows of the link's payload: everything
 * else consistent (sections, checksum), so the row limit is the only rule it breaks. */
static void oversized_header(const struct kvr_wire_limits *lim, uint32_t payload,
                             uint32_t n_timings, uint8_t h[KVR_WIRE_HEADER_BYTES],
                             uint64_t *body_bytes)
{
    uint32_t n_rows = lim->max_rows + 1;
    uint64_t elem = payload == KVR_WIRE_PAYLOAD_TOKENS ? 4 : kvr_wire_payload_elem_bytes(payload);
    uint64_t pay = payload == KVR_WIRE_PAYLOAD_TOKENS ? (uint64_t)n_rows * elem
                                                      : (uint64_t)n_rows * lim->n_embd * elem;
    *body_bytes = KVR_WIRE_SEG_BYTES + pay + (uint64_t)n_timings * KVR_WIRE_TIMING_BYTES;
    memset(h, 0, KVR_WIRE_HEADER_BYTES);
    kvr_st32(h, KVR_WIRE_FRAME_MAGIC);
    h[4] = KVR_WIRE_BATCH;
    h[5] = (uint8_t)payload;
    kvr_st64(h + 8, 0x726f677565ull); /* batch id: "rogue" */
    kvr_st32(h + 16, n_rows);
    kvr_st16(h + 20, 1);
    kvr_st16(h + 24, (uint16_t)n_timings);
    kvr_st32(h + 28, (uint32_t)pay);
    kvr_st32(h + 32, (uint32_t)*body_bytes);
    kvr_st32(h + 36, kvr_crc32c(h, 36));
}

static int run(const struct opts *o)
{
    struct kvr_err err = {0};
    struct kvr_plan *plan = kvr_calloc(1, sizeof *plan);
    struct kvr_gguf *g = NULL;
    struct kvr_link link = {.fd = -1};
    uint8_t *frame = NULL, *sealed = NULL;
    int rc = 1;
    char path[KVR_PLAN_PATH_BYTES];
    struct kvr_hparams hp;
    if (!plan || kvr_plan_load(plan, o->plan_path, &err) || kvr_plan_validate(plan, 0, &err) ||
        kvr_plan_path(plan, plan->model_path, path, sizeof path, &err) ||
        kvr_gguf_open(&g, path, &err) || kvr_hparams_read(&hp, g, &err)) {
        fprintf(stderr, "kvr_rogue: %s: %s\n", o->plan_path, plan ? err.msg : "out of memory");
        goto out;
    }
    if (o->as >= plan->n_stages) {
        fprintf(stderr, "kvr_rogue: the plan has %u stages\n", plan->n_stages);
        goto out;
    }
    bool tail = o->as + 1 == plan->n_stages;
    int recv_idx = tail ? KVR_WIRE_RECV_BRIDGE : (int)o->as + 1;
    const char *addr = tail ? plan->bridge_addr : plan->stages[o->as + 1].addr;
    struct kvr_wire_limits lim;
    if (kvr_wire_limits_init(&lim, plan, hp.n_embd, hp.n_vocab, recv_idx, &err)) {
        fprintf(stderr, "kvr_rogue: %s\n", err.msg);
        goto out;
    }
    int fd;
    if (kvr_net_connect(addr, kvr_net_deadline(2000), &fd, &err) ||
        kvr_link_init(&link, fd, addr, &lim, KVR_LINK_SEND, &err)) {
        fprintf(stderr, "kvr_rogue: %s: %s\n", addr, err.msg);
        goto out;
    }
    if (kvr_link_handshake_client(&link, plan, KVR_AUTH_ROLE_STAGE, o->as, 5000, &err)) {
        printf("handshake: refused: %s\n", err.msg);
        rc = 3;
        goto out;
    }
    printf("handshake: accepted by %s as stage %u\n", addr, o->as);
    /* Behave like a real sender up to the frame: wait for the receiver's credits. */
    uint32_t credits = 0;
    uint64_t until = kvr_now_ns() + 3000000000ull;
    while (credits == 0 && kvr_now_ns() < until)
        if (kvr_credit_take(link.fd, &credits, 100))
            break;
    printf("credits: %u\n", credits);
    fflush(stdout);

    uint32_t payload = lim.batch_payload;
    uint32_t n_timings = lim.min_timings;
    if (o->send == SEND_NONE) {
        kvr_sleep_ns((uint64_t)o->hold_ms * 1000000ull);
        rc = 0;
    } else if (o->send == SEND_OVERSIZED) {
        uint8_t h[KVR_WIRE_HEADER_BYTES];
        uint64_t body;
        oversized_header(&lim, payload, n_timings, h, &body);
        uint8_t sealed_h[KVR_SEAL_SEALED_HEADER_BYTES];
        size_t hn = sizeof h;
        const uint8_t *hp_out = h;
        if (link.sealed) { /* the header alone, as one record: it opens, then breaks a limit */
            struct iovec hv = {h, sizeof h};
            if (kvr_seal_frame(&link.seal_tx, &hv, 1, sizeof h, sealed_h, sizeof sealed_h, &hn,
                               &err)) {
                fprintf(stderr, "kvr_rogue: %s\n", err.msg);
                goto out;
            }
            hp_out = sealed_h;
        }
        size_t sent = send_raw(link.fd, hp_out, hn);
        /* Then body bytes, as a sender that believes its header would: a receiver that
         * checks the header first has closed the link before most of them. */
        uint8_t zeros[4096] = {0};
        uint64_t left = body;
        while (left > 0 && sent > 0) {
            size_t n = left < sizeof zeros ? (size_t)left : sizeof zeros;
            size_t w = send_raw(link.fd, zeros, n);
            if (w < n)
                break;
            left -= w;
        }
        printf("sent: BATCH header claiming %u rows (row_width %u), %llu of %llu body bytes "
               "accepted by the socket\n",
               lim.max_rows + 1, lim.max_rows, (unsigned long long)(body - left),
               (unsigned long long)body);
        fflush(stdout);
        int ms = wait_closed(link.fd, o->wait_ms);
        if (ms < 0) {
            printf("receiver kept the link open for %d ms\n", o->wait_ms);
            rc = 4;
        } else {
            printf("receiver closed the link after %d ms\n", ms);
            rc = 0;
        }
    } else {
        /* One prefill row of sequence 0 at position 0, the timing records this receiver
         * expects, and a zero payload of the link's type. */
        struct kvr_seg seg = {0, 0, 1, KVR_SEG_PREFILL};
        struct kvr_wire_timing tim[KVR_PLAN_MAX_STAGES];
        memset(tim, 0, sizeof tim);
        for (uint32_t i = 0; i < n_timings; i++)
            tim[i].stage = i;
        size_t pay = payload == KVR_WIRE_PAYLOAD_TOKENS
                         ? 4
                         : (size_t)hp.n_embd * kvr_wire_payload_elem_bytes(payload);
        void *rows = kvr_calloc(1, pay);
        size_t cap = KVR_WIRE_HEADER_BYTES + KVR_WIRE_SEG_BYTES + pay +
                     KVR_PLAN_MAX_STAGES * KVR_WIRE_TIMING_BYTES;
        frame = kvr_malloc(cap);
        struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                                 .batch_id = 0x726f677565ull,
                                 .segs = &seg,
                                 .n_segs = 1,
                                 .payload = payload,
                                 .payload_data = rows,
                                 .payload_bytes = pay,
                                 .timings = tim,
                                 .n_timings = n_timings};
        size_t total = 0;
        int erc = rows && frame ? kvr_wire_encode_flat(&m, frame, cap, &total, &err) : KVR_ENOMEM;
        kvr_free(rows);
        if (erc) {
            fprintf(stderr, "kvr_rogue: cannot encode the frame: %s\n", err.msg);
            goto out;
        }
        size_t body = total - KVR_WIRE_HEADER_BYTES;
        size_t hdr = KVR_WIRE_HEADER_BYTES;
        const uint8_t *wire = frame;
        if (link.sealed) {
            size_t cap2 = kvr_seal_frame_bytes(total), n2 = 0;
            sealed = kvr_malloc(cap2);
            struct iovec fv = {frame, total};
            if (!sealed || kvr_seal_frame(&link.seal_tx, &fv, 1, total, sealed, cap2, &n2, &err)) {
                fprintf(stderr, "kvr_rogue: cannot seal the frame: %s\n",
                        sealed ? err.msg : "out of memory");
                goto out;
            }
            wire = sealed, total = n2, hdr = KVR_SEAL_SEALED_HEADER_BYTES;
            body = total - hdr;
        }
        if (o->send == SEND_TRUNCATED) {
            size_t cut = hdr + body / 2;
            size_t sent = send_raw(link.fd, wire, cut);
            printf("sent: %zu of a %zu-byte%s BATCH frame (header and %zu of %zu body bytes), "
                   "then closed\n",
                   sent, total, link.sealed ? " sealed" : "", cut - hdr, body);
            rc = sent == cut ? 0 : 1;
        } else {
            uint8_t *w = link.sealed ? sealed : frame;
            w[hdr + body / 2] ^= 0x10;
            size_t sent = send_raw(link.fd, w, total);
            printf("sent: a %zu-byte%s BATCH frame with byte %zu flipped (%zu bytes went out)\n",
                   total, link.sealed ? " sealed" : "", hdr + body / 2, sent);
            fflush(stdout);
            int ms = wait_closed(link.fd, o->wait_ms);
            if (ms < 0) {
                printf("receiver kept the link open for %d ms\n", o->wait_ms);
                rc = 4;
            } else {
                printf("receiver closed the link after %d ms\n", ms);
                rc = 0;
            }
        }
    }
out:
    fflush(stdout);
    kvr_link_fini(&link);
    kvr_free(frame);
    kvr_free(sealed);
    kvr_gguf_close(g);
    if (plan) {
        kvr_plan_wipe(plan);
        kvr_free(plan);
    }
    return rc;
}

int main(int argc, char **argv)
{
    struct opts o;
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    signal(SIGPIPE, SIG_IGN);
    kvr_log_set_tag("rogue");
    return run(&o);
}
