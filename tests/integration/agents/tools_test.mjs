// tools_test.mjs - tool calls and the Responses API through the official OpenAI SDK and the
// OpenAI Agents SDK, against a running `kvasir serve` of a random-weight model with a
// Hermes-style tool template. Run by tests/integration/tools_sdk.sh, which sets
//   KVASIR_BASE_URL  e.g. http://127.0.0.1:41234/v1
//   KVASIR_MODEL     the model id the server reports
// A random model's words mean nothing: these tests check shapes, that calls the server
// reports carry arguments valid under the tool's schema, and that forced calls (the
// grammar at the tail) always come.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import Ajv from 'ajv';

const baseURL = process.env.KVASIR_BASE_URL;
const model = process.env.KVASIR_MODEL;
assert.ok(baseURL && model, 'KVASIR_BASE_URL and KVASIR_MODEL must be set');
const client = new OpenAI({ baseURL, apiKey: 'unused', timeout: 60_000, maxRetries: 0 });
const ajv = new Ajv({ strict: false });

const weather = {
    type: 'object',
    properties: {
        city: { type: 'string', maxLength: 12 },
        unit: { type: 'string', enum: ['celsius', 'fahrenheit'] },
        days: { type: 'integer', minimum: 1, maximum: 7 },
    },
    required: ['city', 'unit'],
    additionalProperties: false,
};
const lookup = {
    type: 'object',
    properties: { id: { type: 'integer' }, exact: { type: 'boolean' } },
    required: ['id'],
    additionalProperties: false,
};
const tools = [
    { type: 'function', function: { name: 'get_weather', description: 'Weather', parameters: weather } },
    { type: 'function', function: { name: 'lookup', parameters: lookup } },
];
const schemaOf = { get_weather: weather, lookup };
const messages = [{ role: 'user', content: 'What is the weather in Oslo?' }];
const base = { model, messages, tools, max_tokens: 200, temperature: 0.8 };

function checkCall(call) {
    assert.equal(call.type, 'function');
    assert.match(call.id, /^call_/);
    const schema = schemaOf[call.function.name];
    assert.ok(schema, `a known tool: ${call.function.name}`);
    const args = JSON.parse(call.function.arguments);
    assert.ok(ajv.validate(schema, args), `${call.function.arguments}: ${ajv.errorsText()}`);
}

// Tool-call deltas as the SDK's own accumulation reads them: by index, id and name once,
// arguments in fragments.
async function streamedCalls(params) {
    const stream = await client.chat.completions.create({ ...params, stream: true });
    const calls = [];
    let finish = null;
    for await (const chunk of stream) {
        const choice = chunk.choices[0];
        if (!choice) continue;
        for (const d of choice.delta.tool_calls ?? []) {
            if (!calls[d.index]) {
                assert.ok(d.id && d.function?.name, 'the first delta of a call has id and name');
                calls[d.index] = { id: d.id, type: d.type, function: { name: d.function.name, arguments: '' } };
            }
            calls[d.index].function.arguments += d.function?.arguments ?? '';
        }
        if (choice.finish_reason) finish = choice.finish_reason;
    }
    return { calls, finish };
}

test('tools with tool_choice auto: an answer, and any call it makes is valid', async () => {
    for (let i = 0; i < 3; i++) {
        const r = await client.chat.completions.create({ ...base, seed: i });
        const c = r.choices[0];
        assert.equal(c.message.role, 'assistant');
        assert.ok(['stop', 'length', 'tool_calls'].includes(c.finish_reason));
        if (c.finish_reason === 'tool_calls') c.message.tool_calls.forEach(checkCall);
    }
});

test('tool_choice required: calls whose arguments validate, streamed and not', async () => {
    for (let i = 0; i < 3; i++) {
        // Up to 8 parallel calls of a random model fit in 1,500 tokens.
        const r = await client.chat.completions.create({ ...base, tool_choice: 'required', seed: i, max_tokens: 1500 });
        const c = r.choices[0];
        assert.equal(c.finish_reason, 'tool_calls');
        assert.ok(c.message.tool_calls.length >= 1);
        c.message.tool_calls.forEach(checkCall);
        const s = await streamedCalls({ ...base, tool_choice: 'required', seed: i, max_tokens: 1500 });
        assert.equal(s.finish, 'tool_calls');
        assert.deepEqual(s.calls.map((x) => [x.function.name, x.function.arguments]),
            c.message.tool_calls.map((x) => [x.function.name, x.function.arguments]));
        s.calls.forEach(checkCall);
    }
});

test('a named tool_choice calls that tool, streamed and not', async () => {
    const named = { type: 'function', function: { name: 'lookup' } };
    for (let i = 0; i < 3; i++) {
        const r = await client.chat.completions.create({
            ...base, tool_choice: named, parallel_tool_calls: false, seed: i,
        });
        const calls = r.choices[0].message.tool_calls;
        assert.equal(calls.length, 1);
        assert.equal(calls[0].function.name, 'lookup');
        checkCall(calls[0]);
        const s = await streamedCalls({ ...base, tool_choice: named, parallel_tool_calls: false, seed: i });
        assert.equal(s.calls.length, 1);
        assert.equal(s.calls[0].function.name, 'lookup');
        checkCall(s.calls[0]);
    }
});

test('a call and its result in the history go through the template', async () => {
    const history = [
        ...messages,
        {
            role: 'assistant', content: null,
            tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo","unit":"celsius"}' } }],
        },
        { role: 'tool', tool_call_id: 'call_1', content: '{"temp": 3}' },
    ];
    const r = await client.chat.completions.create({ ...base, messages: history, max_tokens: 4 });
    const without = await client.chat.completions.create({ ...base, max_tokens: 4 });
    assert.ok(r.usage.prompt_tokens > without.usage.prompt_tokens + 10, 'the call and result are in the prompt');
});

test('bad tool input is a 400 naming it', async () => {
    const cases = [
        [{ ...base, tool_choice: { type: 'function', function: { name: 'nope' } } }, 'tool_choice'],
        [{ ...base, tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'objekt' } } }] },
            'tools[0].function.parameters'],
        [{ ...base, messages: [...messages, { role: 'tool', content: 'x' }] }, 'messages[1].tool_call_id'],
    ];
    for (const [params, param] of cases) {
        await assert.rejects(client.chat.completions.create(params), (err) => {
            assert.ok(err instanceof OpenAI.BadRequestError);
            assert.equal(err.param, param);
            return true;
        });
    }
});

// ---- the Responses API ----

const rtools = [{ type: 'function', name: 'get_weather', description: 'Weather', parameters: weather, strict: false }];

test('responses.create: plain', async () => {
    const r = await client.responses.create({ model, input: 'Say hi.', instructions: 'Be brief.', max_output_tokens: 12 });
    assert.equal(r.object, 'response');
    assert.match(r.id, /^resp_/);
    assert.ok(['completed', 'incomplete'].includes(r.status));
    assert.equal(typeof r.output_text, 'string');
    assert.equal(r.output.at(-1).type, 'message');
    assert.ok(r.usage.output_tokens <= 12);
    if (r.status === 'incomplete') assert.equal(r.usage.output_tokens, 12);
});

test('responses.create: streamed, deltas add up to the final text', async () => {
    const stream = await client.responses.create({ model, input: 'Say hi.', max_output_tokens: 12, stream: true });
    const types = [];
    let text = '';
    let final = null;
    for await (const ev of stream) {
        types.push(ev.type);
        if (ev.type === 'response.output_text.delta') text += ev.delta;
        if (ev.type === 'response.completed' || ev.type === 'response.incomplete') final = ev.response;
    }
    assert.equal(types[0], 'response.created');
    assert.ok(final, 'a completed or incomplete event');
    const out = final.output.find((o) => o.type === 'message');
    assert.equal(out.content[0].text, text);
});

test('responses.create with a tool: auto gives an answer', async () => {
    const r = await client.responses.create({ model, input: 'Weather in Oslo?', tools: rtools, max_output_tokens: 16 });
    assert.ok(r.output.length >= 1);
    for (const o of r.output.filter((x) => x.type === 'function_call'))
        assert.ok(ajv.validate(weather, JSON.parse(o.arguments)), ajv.errorsText());
});

test('responses.create with a tool: a forced call, then its output and a follow-up', async () => {
    const r = await client.responses.create({ model, input: 'Weather in Oslo?', tools: rtools, tool_choice: 'required', parallel_tool_calls: false, max_output_tokens: 200 });
    const call = r.output.find((o) => o.type === 'function_call');
    assert.ok(call, 'a function_call item');
    assert.equal(call.name, 'get_weather');
    assert.ok(ajv.validate(weather, JSON.parse(call.arguments)), ajv.errorsText());
    const next = await client.responses.create({
        model, previous_response_id: r.id, tools: rtools, max_output_tokens: 8,
        input: [{ type: 'function_call_output', call_id: call.call_id, output: '{"temp": 3}' }],
    });
    assert.ok(next.usage.input_tokens > r.usage.input_tokens, 'the earlier turn is in the prompt');
    const stream = await client.responses.create({ model, input: 'Weather?', tools: rtools, tool_choice: 'required', parallel_tool_calls: false, max_output_tokens: 200, stream: true });
    const args = {};
    const done = [];
    for await (const ev of stream) {
        if (ev.type === 'response.function_call_arguments.delta') args[ev.item_id] = (args[ev.item_id] ?? '') + ev.delta;
        if (ev.type === 'response.output_item.done' && ev.item.type === 'function_call') done.push(ev.item);
    }
    assert.ok(done.length >= 1, 'function_call items done');
    for (const item of done) {
        assert.equal(item.arguments, args[item.id], 'the deltas add up to the arguments');
        assert.ok(ajv.validate(weather, JSON.parse(item.arguments)), ajv.errorsText());
    }
});

// ---- the OpenAI Agents SDK ----

test('an agent runs a tool and the model sees its result', async () => {
    const agents = await import('@openai/agents');
    const { z } = await import('zod');
    agents.setTracingDisabled(true);
    agents.setDefaultOpenAIClient(client);
    agents.setOpenAIAPI('responses');
    const seen = [];
    const getWeather = agents.tool({
        name: 'get_weather',
        description: 'The weather in a city',
        parameters: z.object({ city: z.string().max(12), unit: z.enum(['celsius', 'fahrenheit']) }),
        execute: async ({ city, unit }) => {
            seen.push(city);
            return `3 degrees ${unit} in ${city}`;
        },
    });
    // The first turn must call the tool (the SDK resets toolChoice to auto after a call);
    // a random model never ends a text answer by itself, so the end-of-generation token (id 2
    // in the synthesized vocabulary) is favoured: the second turn, which sees the tool's
    // result, answers at once, and the run completes instead of ending "incomplete".
    const agent = new agents.Agent({
        name: 'weather', instructions: 'Answer with the weather.', model, tools: [getWeather],
        modelSettings: {
            toolChoice: 'required', parallelToolCalls: false, maxTokens: 200, temperature: 0.8,
            providerData: { logit_bias: { 2: 100 } },
        },
    });
    const result = await agents.run(agent, 'Weather in Oslo?', { maxTurns: 3 });
    assert.equal(seen.length, 1, 'the tool ran once');
    const items = result.history;
    const out = items.find((i) => i.type === 'function_call_result');
    assert.ok(out, 'the tool result is in the history');
    // The second turn's prompt is longer by the call and its result, as the template wrote them.
    assert.equal(result.rawResponses.length, 2);
    assert.ok(result.rawResponses[1].usage.inputTokens > result.rawResponses[0].usage.inputTokens + 10);
    assert.equal(typeof result.finalOutput, 'string');
});
