/* tokenizer.h - text <-> token ids, from the vocabulary stored in a GGUF file.
 *
 * Two tokenizer models, chosen by the GGUF key tokenizer.ggml.model:
 *   "llama"  SentencePiece (SPM): spaces become U+2581 "▁", a leading space is added, the
 *            text is split into UTF-8 characters which are merged pairwise, highest piece
 *            score first (leftmost on ties), and characters with no piece of their own fall
 *            back to <0xXX> byte tokens.
 *   "gpt2"   byte-level BPE: a pre-tokenizer splits the text into words, each word's
 *            bytes are mapped to printable code points, and merges are applied by rank
 *            (lowest first, leftmost on ties). The pre-tokenizer is the one named by
 *            tokenizer.ggml.pre, from the table in tokenizer_pre.c: gpt-2 (also phi-2,
 *            roberta-bpe, mpt, olmo, jais), llama-bpe (Llama 3: llama3, llama-v3; and
 *            dbrx, smaug-bpe), qwen2 (deepseek-r1-qwen, megrez, stablelm2), deepseek-llm,
 *            deepseek-coder, deepseek-v3, falcon, starcoder (refact, command-r, smollm,
 *            codeshell, exaone, minerva-7b), bloom, viking and default, and more aliases
 *            (`kvasir tokenize --list-pre`). Other names, and a missing key, are refused.
 * Both reproduce llama.cpp's tokenizers id for id (its test vectors are the unit test; the
 * pre-tokenizers without vectors are compared with llama.cpp's llama-tokenize by
 * tests/integration/tokenize_peer.sh).
 *
 * Special tokens: tokens of type control or unknown (e.g. <s>, <|im_start|>) are only
 * recognised in text when the caller asks for it (parse_special); tokens of type
 * user-defined are always split out first, as llama.cpp does. Longer specials are matched
 * before shorter ones, each leftmost first. The end-of-turn pieces (see kvr_tok_is_eog) and
 * the fill-in-the-middle markers (<|fim_prefix|>, <|repo_name|>, ...) are control tokens
 * whatever type the file gives them, as llama.cpp makes them; kvr_tok_type reports that.
 *
 * Memory: everything the tokenizer needs is allocated by kvr_tok_create. Encoding needs
 * working memory proportional to the text; it lives in a struct kvr_tok_scratch that the
 * caller creates once for the longest text it will encode, so encode allocates nothing.
 *
 * Ownership and threads: a struct kvr_tok copies what it needs from the GGUF (it does not
 * borrow the file) and is immutable after create, so any number of threads may use one
 * concurrently. A scratch or a struct kvr_detok belongs to one thread at a time. */
#ifndef KVR_MODEL_TOKENIZER_H
#define KVR_MODEL_TOKENIZER_H

#include "core/err.h"
#include "model/gguf.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kvr_tok_kind {
    KVR_TOK_SPM = 0, /* tokenizer.ggml.model = "llama" */
    KVR_TOK_BPE = 1, /* tokenizer.ggml.model = "gpt2" */
    KVR_TOK_KIND_COUNT = 2
};

/* Token types, as numbered in tokenizer.ggml.token_type. */
enum kvr_tok_type {
    KVR_TOK_TYPE_UNDEFINED = 0,
    KVR_TOK_TYPE_NORMAL = 1,
    KVR_TOK_TYPE_UNKNOWN = 2,
    KVR_TOK_TYPE_CONTROL = 3,
    KVR_TOK_TYPE_USER_DEFINED = 4,
    KVR_TOK_TYPE_UNUSED = 5,
    KVR_TOK_TYPE_BYTE = 6,
    KVR_TOK_TYPE_COUNT = 7
};

/* Limits enforced on a vocabulary (larger ones are rejected with KVR_ERANGE). */
#define KVR_TOK_MAX_VOCAB (1 << 24)
#define KVR_TOK_MAX_PIECE_BYTES 4096
#define KVR_TOK_MAX_EOG 16

struct kvr_tok;

/* A vocabulary described by arrays, for kvr_tok_create_from_vocab (tests, fuzzing, and the
 * GGUF path, which fills one of these from the file). Every pointer is borrowed for the
 * duration of the call only. */
struct kvr_tok_vocab {
    enum kvr_tok_kind kind;
    int64_t n_tokens;
    /* n_tokens pieces (bytes, not NUL-terminated). */
    const struct kvr_gguf_str *tokens;
    /* n_tokens packed little-endian f32 at any alignment; NULL: all 0. */
    const void *scores;
    /* n_tokens packed little-endian i32 (enum kvr_tok_type); NULL: all normal. */
    const void *types;
    /* BPE only: n_merges "left right" strings; a rule's rank is its index. */
    int64_t n_merges;
    const struct kvr_gguf_str *merges;
    /* BPE only: the pre-tokenizer's name (tokenizer.ggml.pre, any alias the table knows);
     * empty: GPT-2's. */
    struct kvr_gguf_str pre;
    /* Special ids: -1 means none. */
    int64_t bos_id, eos_id, unk_id, pad_id, eot_id, eom_id;
    /* -1 = the model's default (SPM: add BOS, no EOS, add space prefix; BPE: none),
     * 0 = false, 1 = true. */
    int add_bos, add_eos, add_space_prefix;
};

/* Fill `v` with the defaults for `kind`: no tokens, SPM ids bos 1 / eos 2 / unk 0 (as
 * llama.cpp assumes when the keys are absent), BPE ids none, flags -1. */
void kvr_tok_vocab_init(struct kvr_tok_vocab *v, enum kvr_tok_kind kind);

/* Build a tokenizer from the tokenizer.ggml.* keys of an open GGUF. Validates everything:
 * array types and lengths agree, token types are known, special ids are in range (the
 * value 0xFFFFFFFF or -1 means "none"), no piece is duplicated, every merge names two
 * pieces whose concatenation is a piece. `g` may be closed afterwards. */
int kvr_tok_create(struct kvr_tok **out, const struct kvr_gguf *g, struct kvr_err *err);
int kvr_tok_create_from_vocab(struct kvr_tok **out, const struct kvr_tok_vocab *v,
                              struct kvr_err *err);
void kvr_tok_destroy(struct kvr_tok *t);

/* The i-th tokenizer.ggml.pre name a BPE vocabulary may give, NULL past the last. */
const char *kvr_tok_pre_name(size_t i);

enum kvr_tok_kind kvr_tok_kind(const struct kvr_tok *t);
int32_t kvr_tok_n_vocab(const struct kvr_tok *t);
int32_t kvr_tok_bos(const struct kvr_tok *t); /* -1 if none */
int32_t kvr_tok_eos(const struct kvr_tok *t); /* -1 if none */
bool kvr_tok_add_bos(const struct kvr_tok *t);
bool kvr_tok_add_eos(const struct kvr_tok *t);
/* End of generation: the EOS id, the EOT/EOM ids of the file (tokenizer.ggml.eot_token_id,
 * eom_token_id), or a token whose text is a known end-of-turn marker, of any type, as in
 * llama.cpp (<|eot_id|>, <|eom_id|>, <|im_end|>, <|end|>, <end_of_turn>, <|endoftext|>,
 * <|end_of_text|>, <EOT>, _<EOT>, <end_of_utterance>, <|return|>, <|call|>, DeepSeek's
 * <｜end▁of▁sentence｜>). At most KVR_TOK_MAX_EOG ids. False for ids out of range. */
bool kvr_tok_is_eog(const struct kvr_tok *t, int32_t id);
enum kvr_tok_type kvr_tok_type(const struct kvr_tok *t, int32_t id); /* UNDEFINED if bad id */
/* The raw piece as stored in the vocabulary (e.g. "▁Hello", "<0x0A>", "<s>"). Points into
 * the tokenizer. KVR_EINVAL for an id out of range. */
int kvr_tok_piece(const struct kvr_tok *t, int32_t id, const char **ptr, size_t *len);
/* The id of a piece given verbatim, or -1. */
int32_t kvr_tok_find(const struct kvr_tok *t, const char *piece, size_t len);

/* ---- encoding ------------------------------------------------------------------------ */

struct kvr_tok_scratch;

/* Working memory for encoding texts of up to max_text_bytes bytes with tokenizer `t` (or
 * any tokenizer of the same kind): about 100 bytes per byte of text for SPM, 250 for BPE.
 * One per thread. KVR_ERANGE above 256 MiB of text. */
int kvr_tok_scratch_create(struct kvr_tok_scratch **out, const struct kvr_tok *t,
                           size_t max_text_bytes);
void kvr_tok_scratch_destroy(struct kvr_tok_scratch *s);
size_t kvr_tok_scratch_max_text(const struct kvr_tok_scratch *s);

/* Encode `len` bytes of `text` into ids[0..max_ids). add_special: prepend BOS if the model
 * adds one (kvr_tok_add_bos) and append EOS if it adds one, as llama.cpp's add_special.
 * parse_special: also recognise control/unknown tokens written in the text.
 * Any bytes are accepted: SPM encodes bytes that are not valid UTF-8 with byte tokens, BPE
 * with the byte-level alphabet, exactly as llama.cpp does.
 * Returns the number of ids, or KVR_EFULL (max_ids too small; ids partly written),
 * KVR_ERANGE (text longer than the scratch allows), KVR_EINVAL (a byte the vocabulary
 * cannot represent at all: no byte token and no unknown token). */
int kvr_tok_encode(const struct kvr_tok *t, struct kvr_tok_scratch *s, const char *text, size_t len,
                   bool add_special, bool parse_special, int32_t *ids, size_t max_ids);

/* ---- decoding ------------------------------------------------------------------------ */

/* The text a token stands for: SPM "▁" becomes a space and byte tokens their byte; BPE
 * code points map back to bytes; user-defined tokens are their text. Control, unknown and
 * unused tokens decode to nothing unless `special` (then their raw text). The bytes need
 * not be valid UTF-8 on their own (a byte token is one byte of a character). Points into
 * the tokenizer; KVR_EINVAL for an id out of range.
 * Round trips: decoding an encoding gives the text back for valid UTF-8 without specials,
 * except that SPM cannot tell a U+2581 in the text from an escaped space (it decodes as a
 * space) and adds a space after every special token it splits out, as llama.cpp does.
 * Unlike llama.cpp's whole-sequence detokenizer, no "clean-up" of spaces before
 * punctuation is done for GPT-2. */
int kvr_tok_decode_piece(const struct kvr_tok *t, int32_t id, bool special, const char **ptr,
                         size_t *len);

/* Streaming detokenizer: ids go in one at a time, and only complete, valid UTF-8 comes out,
 * never half of a multi-byte character (pending bytes wait for the next id). Invalid bytes
 * become U+FFFD (one per maximal invalid subsequence, as the Unicode standard recommends);
 * flush emits U+FFFD for an incomplete character left at the end.
 * Leading space: SentencePiece adds a space in front of the text when encoding; a decoder
 * started with `text_start` removes one leading space from the first piece that produces
 * text (BOS and other control tokens before it are skipped, unless `special` makes them
 * print), as SentencePiece and llama.cpp's SPM detokenizer after BOS do. Only tokenizers
 * that add that space strip it (SPM by default, never GPT-2 BPE). Continuations (tokens
 * generated after a prompt) must start with text_start = false so the space between words
 * is kept. Caller-owned, fixed size, no allocation. */
struct kvr_detok {
    uint8_t pending[4]; /* bytes of an incomplete UTF-8 character */
    uint8_t n_pending;
    uint8_t need;     /* total length of the pending character */
    bool strip_space; /* remove a leading ' ' from the next non-empty piece */
    bool special;     /* output control tokens' text too */
};

void kvr_detok_init(struct kvr_detok *d, bool text_start, bool special);
/* A buffer of this many bytes always suffices for one push or one flush. */
size_t kvr_detok_max_bytes(const struct kvr_tok *t);
/* Returns the number of bytes written to out (not NUL-terminated), KVR_EFULL if cap is too
 * small (nothing consumed, state unchanged), KVR_EINVAL for an id out of range. */
int kvr_detok_push(const struct kvr_tok *t, struct kvr_detok *d, int32_t id, char *out, size_t cap);
int kvr_detok_flush(struct kvr_detok *d, char *out, size_t cap);

#endif
