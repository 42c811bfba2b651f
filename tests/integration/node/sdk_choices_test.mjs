// sdk_choices_test.mjs - top_logprobs and n > 1 through the official OpenAI Node SDK, against
// the server tests/integration/openai_sdk.sh starts (same environment as sdk_test.mjs).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const client = new OpenAI({
    baseURL: process.env.KVASIR_BASE_URL, apiKey: process.env.KVASIR_API_KEY,
    timeout: 30_000, maxRetries: 0,
});
const model = process.env.KVASIR_MODEL;
const N = 12; // tokens per answer
const chatParams = {
    model,
    messages: [{ role: 'user', content: 'Tell me a story about a cat.' }],
    max_tokens: N, ignore_eos: true,
};

test('chat top_logprobs: 5 sorted alternatives per token, the greedy token the first', async () => {
    const r = await client.chat.completions.create({
        ...chatParams, temperature: 0, logprobs: true, top_logprobs: 5,
    });
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, N);
    for (const t of content) {
        assert.equal(t.top_logprobs.length, 5);
        const v = t.top_logprobs.map((a) => a.logprob);
        assert.deepEqual(v, [...v].sort((a, b) => b - a));
        assert.equal(t.top_logprobs[0].token, t.token);
        assert.equal(t.top_logprobs[0].logprob, t.logprob);
        assert.deepEqual(t.top_logprobs[0].bytes, t.bytes);
    }
});

test('completions logprobs: 3 alternatives by text per token', async () => {
    const r = await client.completions.create({
        model, prompt: 'Once upon a time', max_tokens: N, temperature: 0, ignore_eos: true,
        logprobs: 3,
    });
    const lp = r.choices[0].logprobs;
    assert.equal(lp.tokens.length, N);
    assert.equal(lp.top_logprobs.length, N);
    lp.top_logprobs.forEach((d, k) => {
        const n = Object.keys(d).length;
        assert.ok(n >= 1 && n <= 3, `${n} alternatives`);
        assert.equal(Math.max(...Object.values(d)), lp.token_logprobs[k]);
    });
});

test('n = 3: three seeded choices, reproducible, usage summed', async () => {
    const params = { ...chatParams, temperature: 1, seed: 1234, n: 3 };
    const r = await client.chat.completions.create(params);
    assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
    const texts = r.choices.map((c) => c.message.content);
    assert.equal(new Set(texts).size, 3, JSON.stringify(texts));
    assert.equal(r.usage.completion_tokens, 3 * N);
    const again = await client.chat.completions.create(params);
    assert.deepEqual(again.choices.map((c) => c.message.content), texts);
    // choice i is what seed + i gives alone
    const one = await client.chat.completions.create({ ...params, n: 1, seed: 1236 });
    assert.equal(one.choices[0].message.content, texts[2]);
});

test('n = 3 streamed: every index, the same texts, one usage', async () => {
    const params = { ...chatParams, temperature: 1, seed: 99, n: 3 };
    const whole = await client.chat.completions.create(params);
    const stream = await client.chat.completions.create({
        ...params, stream: true, stream_options: { include_usage: true },
    });
    const text = ['', '', ''], finish = [null, null, null];
    let usage = null;
    for await (const chunk of stream) {
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices) {
            text[ch.index] += ch.delta.content ?? '';
            if (ch.finish_reason) finish[ch.index] = ch.finish_reason;
        }
    }
    assert.deepEqual(text, whole.choices.map((c) => c.message.content));
    assert.deepEqual(finish, ['length', 'length', 'length']);
    assert.equal(usage.completion_tokens, 3 * N);
    assert.equal(usage.prompt_tokens, whole.usage.prompt_tokens);
});

test('n = 2 completions with logprobs', async () => {
    const r = await client.completions.create({
        model, prompt: 'The dog', max_tokens: N, temperature: 0.8, seed: 5, n: 2, logprobs: 2,
        ignore_eos: true,
    });
    assert.equal(r.choices.length, 2);
    for (const c of r.choices) assert.equal(c.logprobs.token_logprobs.length, N);
});

test('out of bounds: n = 17 and top_logprobs = 21 raise BadRequestError', async () => {
    for (const [extra, param] of [[{ n: 17 }, 'n'], [{ logprobs: true, top_logprobs: 21 }, 'top_logprobs']]) {
        await assert.rejects(client.chat.completions.create({ ...chatParams, ...extra }), (err) => {
            assert.ok(err instanceof OpenAI.BadRequestError, `got ${err?.constructor?.name}`);
            assert.equal(err.param, param);
            return true;
        });
    }
});
