// sdk_test.mjs - the official OpenAI Node SDK against a running `kvasir serve`.
// Run by tests/integration/openai_sdk.sh, which starts the server and sets:
//   KVASIR_BASE_URL  e.g. http://127.0.0.1:41234/v1
//   KVASIR_API_KEY   the key the server was started with
//   KVASIR_MODEL     the model id the server reports
// Greedy decoding (temperature 0) with ignore_eos makes answers repeatable, so streamed
// text can be compared with the non-streamed answer to the same request.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const baseURL = process.env.KVASIR_BASE_URL;
const apiKey = process.env.KVASIR_API_KEY;
const model = process.env.KVASIR_MODEL;
assert.ok(baseURL && apiKey && model, 'KVASIR_BASE_URL, KVASIR_API_KEY and KVASIR_MODEL must be set');

const client = new OpenAI({ baseURL, apiKey, timeout: 30_000, maxRetries: 0 });
const N = 24; // tokens per answer

function checkUsage(usage, completionTokens) {
    assert.ok(usage, 'usage is present');
    assert.ok(usage.prompt_tokens > 0, `prompt_tokens ${usage.prompt_tokens}`);
    assert.equal(usage.completion_tokens, completionTokens);
    assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
}

const completionParams = {
    model, prompt: 'Once upon a time', max_tokens: N, temperature: 0, ignore_eos: true,
};
const chatParams = {
    model,
    messages: [
        { role: 'system', content: 'You tell short stories.' },
        { role: 'user', content: 'Tell me a story about a cat.' },
    ],
    max_tokens: N, temperature: 0, ignore_eos: true,
};

test('models.list and models.retrieve report the served model', async () => {
    const ids = [];
    for await (const m of client.models.list()) ids.push(m.id);
    assert.deepEqual(ids, [model]);
    const m = await client.models.retrieve(model);
    assert.equal(m.id, model);
    assert.equal(m.object, 'model');
    await assert.rejects(client.models.retrieve('no-such-model'), OpenAI.NotFoundError);
});

test('completions, non-streaming', async () => {
    const r = await client.completions.create(completionParams);
    assert.equal(r.object, 'text_completion');
    assert.match(r.id, /^cmpl-/);
    assert.equal(r.model, model);
    assert.equal(r.choices.length, 1);
    assert.equal(typeof r.choices[0].text, 'string');
    assert.ok(r.choices[0].text.length > 0, 'some text');
    assert.equal(r.choices[0].finish_reason, 'length');
    checkUsage(r.usage, N);
    // Greedy: the same request gives the same text.
    const again = await client.completions.create(completionParams);
    assert.equal(again.choices[0].text, r.choices[0].text);
});

test('chat completions, non-streaming', async () => {
    const r = await client.chat.completions.create(chatParams);
    assert.equal(r.object, 'chat.completion');
    assert.match(r.id, /^chatcmpl-/);
    assert.equal(r.choices.length, 1);
    const c = r.choices[0];
    assert.equal(c.message.role, 'assistant');
    assert.equal(typeof c.message.content, 'string');
    assert.ok(['stop', 'length'].includes(c.finish_reason), `finish_reason ${c.finish_reason}`);
    assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= N);
    checkUsage(r.usage, r.usage.completion_tokens);
});

test('chat completions, streaming: same text as non-streaming, finish_reason, usage', async () => {
    const whole = await client.chat.completions.create(chatParams);
    const stream = await client.chat.completions.create({
        ...chatParams, stream: true, stream_options: { include_usage: true },
    });
    let text = '', finish = null, usage = null, chunks = 0, role = null;
    for await (const chunk of stream) {
        chunks++;
        assert.equal(chunk.object, 'chat.completion.chunk');
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices) {
            if (ch.delta.role) role = ch.delta.role;
            text += ch.delta.content ?? '';
            if (ch.finish_reason) finish = ch.finish_reason;
        }
    }
    assert.ok(chunks >= 3, `only ${chunks} chunks`);
    assert.equal(role, 'assistant');
    assert.equal(text, whole.choices[0].message.content);
    assert.equal(finish, whole.choices[0].finish_reason);
    checkUsage(usage, whole.usage.completion_tokens);
});

test('completions, streaming: same text as non-streaming, finish_reason, usage', async () => {
    const whole = await client.completions.create(completionParams);
    const stream = await client.completions.create({
        ...completionParams, stream: true, stream_options: { include_usage: true },
    });
    let text = '', finish = null, usage = null, chunks = 0;
    for await (const chunk of stream) {
        chunks++;
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices) {
            text += ch.text;
            if (ch.finish_reason) finish = ch.finish_reason;
        }
    }
    assert.ok(chunks >= 3, `only ${chunks} chunks`);
    assert.equal(text, whole.choices[0].text);
    assert.equal(finish, 'length');
    checkUsage(usage, N);
});

test('streaming without include_usage still ends with a finish_reason', async () => {
    const stream = await client.completions.create({ ...completionParams, stream: true });
    let finish = null, sawUsage = false;
    for await (const chunk of stream) {
        if (chunk.usage) sawUsage = true;
        for (const ch of chunk.choices) if (ch.finish_reason) finish = ch.finish_reason;
    }
    assert.equal(finish, 'length');
    assert.equal(sawUsage, false);
});

test('a stop string cuts the text where it first appears', async () => {
    const whole = (await client.completions.create(completionParams)).choices[0].text;
    // A stop string taken from the middle of the greedy answer.
    const chars = [...whole];
    assert.ok(chars.length >= 6, `answer too short for this test: ${JSON.stringify(whole)}`);
    const mid = Math.floor(chars.length / 2);
    const stop = chars.slice(mid, mid + 2).join('');
    const r = await client.completions.create({ ...completionParams, stop: [stop] });
    assert.equal(r.choices[0].text, whole.slice(0, whole.indexOf(stop)));
    assert.equal(r.choices[0].finish_reason, 'stop');
});

test('chat logprobs: one entry per generated token', async () => {
    const r = await client.chat.completions.create({ ...chatParams, logprobs: true });
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, r.usage.completion_tokens);
    for (const t of content) {
        assert.equal(typeof t.token, 'string');
        assert.ok(t.logprob <= 0, `logprob ${t.logprob}`);
    }
});

test('a wrong API key raises AuthenticationError (401)', async () => {
    const bad = new OpenAI({ baseURL, apiKey: apiKey + '-wrong', timeout: 10_000, maxRetries: 0 });
    await assert.rejects(bad.completions.create(completionParams), (err) => {
        assert.ok(err instanceof OpenAI.AuthenticationError, `got ${err?.constructor?.name}`);
        assert.equal(err.status, 401);
        assert.equal(err.type, 'authentication_error');
        return true;
    });
    await assert.rejects(bad.chat.completions.create({ ...chatParams, stream: true }),
        OpenAI.AuthenticationError);
});

test('an invalid request raises BadRequestError (400) naming the parameter', async () => {
    await assert.rejects(client.completions.create({ ...completionParams, max_tokens: 0 }),
        (err) => {
            assert.ok(err instanceof OpenAI.BadRequestError, `got ${err?.constructor?.name}`);
            assert.equal(err.status, 400);
            assert.equal(err.param, 'max_tokens');
            return true;
        });
});
