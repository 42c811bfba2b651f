/* sim_ring.c - the pipelined fake ring of sim_ring.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "sim_ring.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t sim_rand(struct sim *m)
{
    m->rng = m->rng * 6364136223846793005ull + 1442695040888963407ull;
    return m->rng >> 33;
}

static double sim_unif(struct sim *m)
{
    return (double)(sim_rand(m) & 0xffffff) / 16777216.0;
}

static void sim_event(void *ctx, struct kvr_sched_req *r, const struct kvr_sched_event *ev)
{
    struct sim *m = ctx;
    struct sim_req *q = r->user;
    if (ev->type == KVR_SCHED_EV_END)
        m->completed += ev->gen.finish == KVR_GEN_FINISH_LENGTH;
    if (ev->type == KVR_SCHED_EV_END && q->measured) {
        uint64_t first_due = r->req.first_token_ms ? r->req.first_token_ms * SIM_MS : UINT64_MAX;
        uint64_t total_due = r->req.total_ms ? r->req.total_ms * SIM_MS : UINT64_MAX;
        m->n_late += ev->gen.finish != KVR_GEN_FINISH_LENGTH ||
                     r->first_token_ns - r->submit_ns > first_due ||
                     ev->gen.t_ns - r->submit_ns > total_due;
    }
    if (ev->type == KVR_SCHED_EV_END && q->measured && ev->gen.finish == KVR_GEN_FINISH_LENGTH &&
        r->est.first_ms > 0 && !r->held_once && m->n_err < SIM_REQS * 8) {
        double first = (r->first_token_ns - r->submit_ns) / 1e6;
        double total = (ev->gen.t_ns - r->submit_ns) / 1e6;
        double est_total = r->est.first_ms + (r->n_generated - 1) * r->est.period_ms;
        m->err_first[m->n_err] = fabs(r->est.first_ms / first - 1);
        m->err_total[m->n_err] = fabs(est_total / total - 1);
        m->n_err++;
        if (getenv("KVR_SIM_DUMP")) /* one line per measured answer, for a closer look */
            fprintf(stderr,
                    "answer: prompt %u class %u tokens %u first %.1f ms (estimated %.1f, raw "
                    "%.1f) whole %.1f ms (estimated %.1f)\n",
                    r->req.n_prompt, r->est.eta_class, r->n_generated, first, r->est.first_ms,
                    r->est.raw_first_ms, total, est_total);
    }
    if (ev->type == KVR_SCHED_EV_END && q == m->target) { /* a future's child: report, end */
        char line[160];
        int n =
            snprintf(line, sizeof line, "%.1f %.1f %.1f %.1f\n",
                     (r->first_token_ns - r->submit_ns) / 1e6, (ev->gen.t_ns - r->submit_ns) / 1e6,
                     r->est.first_ms, r->est.first_ms + (r->n_generated - 1) * r->est.period_ms);
        _exit(write(m->target_fd, line, (size_t)n) == n ? 0 : 1);
    }
    if (ev->type == KVR_SCHED_EV_DETACH) {
        q->busy = false;
        m->resubmit += q->closed_loop;
    }
}

static double sim_stage_ms(uint32_t stage, double rows, double pairs, double jitter)
{
    double t = 3.0 + 0.9 * rows + 0.0004 * pairs;
    return (stage ? 1.1 * t : t) * jitter;
}

#define SIM_HOP_NS 300000ull

static void sim_pump(struct sim *m)
{
    const struct kvr_wire_msg *msg;
    while (m->n_ring < 4 && (msg = kvr_sched_next_batch(m->s, m->now)) != NULL) {
        struct sim_batch *b = &m->ring[(m->head + m->n_ring++) % 4];
        b->id = msg->batch_id;
        b->n_segs = msg->n_segs;
        memcpy(b->segs, msg->segs, msg->n_segs * sizeof *b->segs);
        double rows = 0, pairs = 0;
        for (uint32_t k = 0; k < msg->n_segs; k++) {
            rows += msg->segs[k].n_tokens;
            pairs += kvr_cost_pairs(msg->segs[k].pos0, msg->segs[k].n_tokens);
        }
        uint64_t t = m->now + SIM_HOP_NS;
        for (uint32_t st = 0; st < 2; st++) {
            double ms = sim_stage_ms(st, rows, pairs, 0.92 + 0.16 * sim_unif(m));
            uint64_t start = t > m->stage_free[st] ? t : m->stage_free[st];
            b->held_ms[st] = ms;
            m->stage_free[st] = start + (uint64_t)(ms * 1e6);
            t = m->stage_free[st] + SIM_HOP_NS;
        }
        b->done_ns = t;
    }
}

static void sim_deliver(struct sim *m)
{
    struct sim_batch *b = &m->ring[m->head];
    struct kvr_wire_result res[64];
    struct kvr_wire_timing tim[2];
    uint32_t n_res = 0;
    for (uint32_t k = 0; k < b->n_segs; k++)
        if (b->segs[k].flags & KVR_SEG_WANTS_TOKEN)
            res[n_res++] = (struct kvr_wire_result){.seq = b->segs[k].seq, .token = 7};
    for (uint32_t st = 0; st < 2; st++)
        tim[st] =
            (struct kvr_wire_timing){.stage = st, .held_ns = (uint64_t)(b->held_ms[st] * 1e6)};
    m->now = b->done_ns > m->now ? b->done_ns : m->now;
    struct kvr_wire_frame f = {.hdr = {.type = KVR_WIRE_RESULT,
                                       .payload = KVR_WIRE_PAYLOAD_RESULTS,
                                       .batch_id = b->id,
                                       .n_segs = b->n_segs,
                                       .n_timings = 2,
                                       .n_results = n_res},
                               .segs = b->segs,
                               .results = res,
                               .timings = tim};
    m->head = (m->head + 1) % 4;
    m->n_ring--;
    struct kvr_err err = {0};
    assert_int_equal(kvr_sched_result(m->s, &f, m->now, &err), 0);
    sim_pump(m);
}

bool sim_submit(struct sim *m, bool closed_loop, uint32_t first_ms, uint32_t total_ms)
{
    struct sim_req *q = NULL;
    for (uint32_t i = 0; i < SIM_REQS && !q; i++)
        if (!m->req[i].busy)
            q = &m->req[i];
    if (!q)
        return false;
    memset(&q->r, 0, sizeof q->r);
    uint32_t n_prompt = 32 + (uint32_t)(sim_rand(m) % (m->prompt_max - 32 + 1));
    for (uint32_t k = 0; k < n_prompt; k++)
        q->prompt[k] = (int32_t)(3 + sim_rand(m) % 500); /* no two prompts share a block */
    q->r.req = (struct kvr_gen_request){.prompt = q->prompt,
                                        .n_prompt = n_prompt,
                                        .max_tokens = 32 + (uint32_t)(sim_rand(m) % 65),
                                        .first_token_ms = first_ms,
                                        .total_ms = total_ms,
                                        .ignore_eos = true};
    kvr_sample_params_default(&q->r.req.sampling);
    q->r.generated = q->gen;
    q->r.user = q;
    q->closed_loop = closed_loop;
    q->measured = !closed_loop;
    struct kvr_refusal why;
    if (kvr_sched_submit(m->s, &q->r, m->now, &why)) {
        if (getenv("KVR_TEST_VERBOSE"))
            print_message("refused (prompt %u): %s\n", n_prompt, why.message);
        return false;
    }
    q->busy = true;
    m->last = q;
    sim_pump(m);
    return true;
}

void sim_init(struct sim *m, uint64_t seed, uint32_t prompt_max)
{
    memset(m, 0, sizeof *m);
    m->prompt_max = prompt_max;
    struct kvr_plan *p = &m->plan;
    p->n_stages = 2;
    p->microbatches = 2;
    p->row_width = 64;
    p->max_seqs = SIM_SEQS;
    p->n_ctx = SIM_CTX;
    p->kv_block_tokens = SIM_BT;
    p->kv_blocks = SIM_SEQS * SIM_CTX / SIM_BT;
    m->rng = seed;
    m->now = 1000 * SIM_MS;
    struct kvr_sched_config cfg = {.plan = p,
                                   .max_ctrl = SIM_MAX_CTRL,
                                   .max_waiting = 64,
                                   .admission = true,
                                   .prefix_cache = true,
                                   .event = sim_event,
                                   .event_ctx = m};
    struct kvr_err err = {0};
    assert_int_equal(kvr_sched_create(&m->s, &cfg, &err), 0);
    kvr_sched_link_up(m->s, m->now);
    sim_pump(m);
    while (m->n_ring)
        sim_deliver(m);
    assert_true(kvr_sched_ring_up(m->s));
}

#define SIM_FUTURES 16

/* The futures experiment (KVR_SIM_FUTURES=FILE): how well could any estimate made at
 * admission do? The request just admitted is followed through SIM_FUTURES futures, each a
 * fork of the whole simulation at this instant with its own random stream from here on (the
 * arrivals, prompts and stage-time jitter to come), so everything known at admission is the
 * same in all of them. A line per future (appended): the mix's longest prompt, the level's
 * rate, the request's number, its prompt, the future's number, then its first-token and
 * whole-answer times (ms) and the estimates of both. bench/estimate_floor.py reads them: the spread
 * of one request's outcomes over its futures is error that no estimate made at admission can avoid.
 */
static void sim_futures(struct sim *m, double rate, uint32_t first_ms, uint32_t total_ms)
{
    m->n_futures_req++;
    for (uint32_t f = 0; f < SIM_FUTURES; f++) {
        int pfd[2];
        assert_int_equal(pipe(pfd), 0);
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(pfd[0]);
            m->target = m->last;
            m->target_fd = pfd[1];
            m->rng ^= 0x9e3779b97f4a7c15ull * (f + 1);
            uint32_t sent = 0, refused = 0;
            sim_run(m, rate, m->now + 600000 * SIM_MS, first_ms, total_ms, &sent, &refused);
            _exit(2); /* the request did not end within 10 minutes (sim_event ends the child) */
        }
        close(pfd[1]);
        char buf[160] = {0};
        ssize_t got = read(pfd[0], buf, sizeof buf - 1);
        close(pfd[0]);
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(got > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0);
        fprintf(m->futures, "%u %.2f %u %u %u %s", m->prompt_max, rate, m->n_futures_req,
                m->last->r.req.n_prompt, f, buf);
    }
}

void sim_run(struct sim *m, double rate, uint64_t until, uint32_t first_ms, uint32_t total_ms,
             uint32_t *n_sent, uint32_t *n_refused)
{
    uint64_t next = rate > 0 ? m->now + (uint64_t)(-log(1 - sim_unif(m)) / rate * 1e9) : UINT64_MAX;
    while (m->now < until) {
        while (m->resubmit > 0) {
            m->resubmit--;
            sim_submit(m, true, SIM_SERVE_FIRST_MS, SIM_SERVE_TOTAL_MS);
        }
        uint64_t done = m->n_ring ? m->ring[m->head].done_ns : UINT64_MAX;
        if (next <= done && next < until) {
            m->now = next;
            (*n_sent)++;
            bool admitted = sim_submit(m, false, first_ms, total_ms);
            *n_refused += !admitted;
            if (admitted && m->futures && !m->target)
                sim_futures(m, rate, first_ms, total_ms);
            next = m->now + (uint64_t)(-log(1 - sim_unif(m)) / rate * 1e9);
        } else if (done < until) {
            sim_deliver(m);
        } else {
            m->now = until;
        }
    }
}

void sim_drain(struct sim *m)
{
    while (m->n_ring)
        sim_deliver(m);
}
