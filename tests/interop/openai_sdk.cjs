// OpenAI's official Node SDK (the `openai` npm package) against tokenwire's HTTP API: a chat
// completion, a completion, a chat stream with usage, a 400 naming its parameter, a 401, and a
// stream the client aborts after its first text. Prints one JSON report on stdout.
//
// Usage: node tests/interop/openai_sdk.cjs BASE_URL TOKEN

"use strict";

const OpenAI = require("openai");

async function main() {
  const [baseURL, token] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey: token, maxRetries: 0 });
  const messages = [{ role: "user", content: "Name a colour" }];
  const report = {};

  const chat = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 8, temperature: 0 });
  report.chat = {
    text: chat.choices[0].message.content,
    role: chat.choices[0].message.role,
    completionTokens: chat.usage.completion_tokens,
    timing: chat.tokenwire.timing,
  };

  const completion = await client.completions.create({ model: "tiny", prompt: "Once upon", max_tokens: 5, temperature: 0 });
  report.completion = { text: completion.choices[0].text, completionTokens: completion.usage.completion_tokens };

  const stream = await client.chat.completions.create({
    model: "tiny", messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let streamed = "";
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) streamed += chunk.choices[0].delta.content || "";
    if (chunk.usage) usage = chunk.usage;
  }
  report.stream = { text: streamed, completionTokens: usage && usage.completion_tokens };

  try {
    await client.chat.completions.create({ model: "tiny", messages, temperature: -1 });
  } catch (error) {
    report.badRequest = { status: error.status, param: error.param, type: error.type };
  }
  try {
    await new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 }).models.list();
  } catch (error) {
    report.unauthenticated = { status: error.status, code: error.code };
  }

  // Aborted after the first text: the server must stop the generation (the test counts it).
  const long = await client.completions.create({ model: "tiny", prompt: "Go on", max_tokens: 150, temperature: 0, stream: true });
  let chunks = 0;
  for await (const chunk of long) {
    if (chunk.choices[0].text) chunks += 1;
    if (chunks >= 1) {
      long.controller.abort();
      break;
    }
  }
  report.aborted = { chunks };
  process.stdout.write(JSON.stringify(report) + "\n");
}

main().catch((error) => {
  process.stderr.write(String(error && error.stack ? error.stack : error) + "\n");
  process.exit(1);
});
