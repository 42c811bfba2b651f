/* fuzz_wire.c - libFuzzer target for the frame codec (src/ring/wire.c).
 *
 * Input: a receiver selector, a wire-dtype selector, then one frame (header and body); see
 * wire_fuzz_plan.h. Every input goes through kvr_wire_decode_header and, if the header is
 * accepted, kvr_wire_decode_body with exactly the bytes that follow (so lengths that
 * disagree with the header are exercised too). Whatever the bytes:
 *   - decoding never reads outside the input, never crashes, never trips a sanitizer;
 *   - a frame that decodes re-encodes (as a stage would forward it) to the very same
 *     bytes: the decoder keeps every field and accepts nothing the encoder cannot write.
 * The body is copied into a buffer of exactly its size so ASan sees any over-read.
 *
 * Seeds: tests/fuzz/corpus/fuzz_wire/, written by test_wire (KVR_WRITE_CORPUS=dir). */
#include "wire_fuzz_plan.h"

#include "ring/plan.h"
#include "ring/wire.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define N_RECEIVERS 5
#define N_DTYPES 3

static struct kvr_plan plans[N_DTYPES];
static struct kvr_wire_limits lims[N_DTYPES][N_RECEIVERS];
static struct kvr_wire_frame frame;
static uint8_t *out;
static size_t out_cap;

static void setup(void)
{
    struct kvr_wire_limits any_max = {0};
    for (unsigned d = 0; d < N_DTYPES; d++) {
        wire_fuzz_plan(&plans[d], d);
        for (unsigned r = 0; r < N_RECEIVERS; r++) {
            if (kvr_wire_limits_init(&lims[d][r], &plans[d], WIRE_FUZZ_N_EMBD, WIRE_FUZZ_N_VOCAB,
                                     wire_fuzz_receiver(r), NULL))
                abort();
            if (lims[d][r].max_frame_bytes > any_max.max_frame_bytes)
                any_max = lims[d][r];
        }
    }
    /* RECV_ANY of the f32 plan has the largest records and payload. */
    if (kvr_wire_frame_init(&frame, &lims[0][0], NULL))
        abort();
    out_cap = any_max.max_frame_bytes;
    out = malloc(out_cap);
    if (!out)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!out)
        setup();
    if (size < WIRE_FUZZ_PREFIX + KVR_WIRE_HEADER_BYTES)
        return 0;
    const struct kvr_wire_limits *lim = &lims[data[1] % N_DTYPES][(data[0] & 0x7f) % N_RECEIVERS];
    const uint8_t *frame_bytes = data + WIRE_FUZZ_PREFIX;
    size_t frame_len = size - WIRE_FUZZ_PREFIX;
    uint8_t head[KVR_WIRE_HEADER_BYTES];
    memcpy(head, frame_bytes, sizeof head);
    if (data[0] & 0x80)
        kvr_st32(head + 36, kvr_crc32c(head, 36));

    struct kvr_wire_header hdr;
    if (kvr_wire_decode_header(head, lim, &hdr, NULL))
        return 0;
    size_t body_len = frame_len - KVR_WIRE_HEADER_BYTES;
    uint8_t *body = malloc(body_len ? body_len : 1);
    if (!body)
        abort();
    memcpy(body, frame_bytes + KVR_WIRE_HEADER_BYTES, body_len);
    if (kvr_wire_decode_body(&frame, &hdr, body, body_len, lim, NULL) == 0) {
        /* Use the payload as a stage would. */
        if (hdr.payload == KVR_WIRE_PAYLOAD_F16 || hdr.payload == KVR_WIRE_PAYLOAD_BF16 ||
            hdr.payload == KVR_WIRE_PAYLOAD_F32) {
            float row[WIRE_FUZZ_N_EMBD];
            size_t elem = kvr_wire_payload_elem_bytes(hdr.payload);
            for (uint32_t r = 0; r < hdr.n_rows; r++)
                kvr_wire_rows_to_f32(hdr.payload,
                                     (const uint8_t *)frame.payload +
                                         (size_t)r * WIRE_FUZZ_N_EMBD * elem,
                                     WIRE_FUZZ_N_EMBD, row);
        }
        /* Forward it: the re-encoded frame must be byte-identical. */
        struct kvr_wire_msg m;
        kvr_wire_msg_forward(&m, &frame);
        m.arg = hdr.arg;
        m.payload = hdr.payload;
        m.payload_data = frame.payload;
        m.payload_bytes = hdr.payload_bytes;
        m.results = frame.results;
        m.n_results = hdr.n_results;
        size_t n = 0;
        if (kvr_wire_encode_flat(&m, out, out_cap, &n, NULL) != 0 || n != frame_len ||
            memcmp(out, head, sizeof head) != 0 ||
            memcmp(out + sizeof head, frame_bytes + sizeof head, n - sizeof head) != 0)
            abort();
    }
    free(body);
    return 0;
}
