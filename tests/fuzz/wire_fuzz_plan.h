/* wire_fuzz_plan.h - the small plan fuzz_wire decodes against, shared with test_wire.c,
 * which writes the seed corpus (tests/fuzz/corpus/fuzz_wire/) in the same input format:
 *
 *   byte 0   bits 0-6: receiver: 0 = any, 1 = stage 0 (head), 2 = stage 1, 3 = stage 2
 *            (tail), 4 = the bridge (taken modulo 5); bit 7: the harness recomputes the
 *            header checksum first, so mutations of header fields reach the field checks
 *            instead of all dying at the checksum
 *   byte 1   wire dtype of the plan: 0 = f32, 1 = f16, 2 = bf16 (modulo 3)
 *   byte 2.. one frame: 40-byte header, then the body
 *
 * The plan is deliberately tiny (8 rows, 4 sequences, 64 positions, n_embd 4, 32 tokens) so
 * the fuzzer reaches every bound quickly. */
#ifndef KVR_WIRE_FUZZ_PLAN_H
#define KVR_WIRE_FUZZ_PLAN_H

#include "ring/plan.h"
#include "ring/wire.h"

#include <stdio.h>
#include <string.h>

#define WIRE_FUZZ_N_EMBD 4
#define WIRE_FUZZ_N_VOCAB 32
#define WIRE_FUZZ_PREFIX 2

static inline void wire_fuzz_plan(struct kvr_plan *p, unsigned dtype_sel)
{
    static const enum kvr_dtype dtypes[3] = {KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16};
    memset(p, 0, sizeof *p);
    strcpy(p->model_path, "m.gguf");
    p->n_stages = 3;
    for (uint32_t i = 0; i < 3; i++) {
        snprintf(p->stages[i].addr, sizeof p->stages[i].addr, "127.0.0.1:%u", 7001 + i);
        p->stages[i].first_layer = i;
        p->stages[i].last_layer = i;
    }
    strcpy(p->bridge_addr, "127.0.0.1:7000");
    p->row_width = 8;
    p->microbatches = 2;
    p->max_seqs = 4;
    p->n_ctx = 64;
    p->kv_block_tokens = 16;
    p->kv_blocks = 16;
    p->wire_dtype = dtypes[dtype_sel % 3];
    p->secret_bytes = 16;
}

/* Receiver of selector byte `sel` (see above). */
static inline int wire_fuzz_receiver(unsigned sel)
{
    static const int receivers[5] = {KVR_WIRE_RECV_ANY, 0, 1, 2, KVR_WIRE_RECV_BRIDGE};
    return receivers[(sel & 0x7f) % 5];
}

#endif
