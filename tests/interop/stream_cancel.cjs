// A StreamGenerate client written with @grpc/grpc-js and @grpc/proto-loader, sharing no code with
// tokenwire: it loads the contract from proto/ and talks to the server named on the command line.
//
// Usage: node tests/interop/stream_cancel.cjs HOST:PORT
//
// On one stream it starts "kept" (greedy, 12 tokens) and "cancelled" (greedy, 200 tokens), sends a
// CancelRequest for "cancelled" after its first chunk, half-closes once both have ended, and
// prints one JSON object: every event per request id, the token ids each one streamed, and the
// call's final status. The exit code is 0 when the call ended OK, 1 otherwise.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const root = path.resolve(__dirname, "..", "..");
const definition = protoLoader.loadSync("tokenwire/v1/inference_service.proto", {
  includeDirs: [path.join(root, "proto")],
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const tokenwire = grpc.loadPackageDefinition(definition).tokenwire.v1;

const target = process.argv[2];
const client = new tokenwire.InferenceService(target, grpc.credentials.createInsecure());
const deadline = new Date(Date.now() + 60_000);
const call = client.StreamGenerate({ deadline });

const report = { events: {}, tokens: {}, finishReasons: {}, status: null };
const open = new Set(["kept", "cancelled"]);
let cancelSent = false;

function generate(requestId, maxNewTokens) {
  return {
    generate: {
      requestId,
      prompt: "The capital of France is",
      sampling: { temperature: 0 },
      stopping: { maxNewTokens, ignoreEos: true },
    },
  };
}

call.on("data", (message) => {
  const id = message.requestId;
  const kind = message.event; // the oneof's name, thanks to `oneofs: true`
  (report.events[id] ??= []).push(kind);
  report.tokens[id] ??= [];
  if (kind === "chunk") {
    report.tokens[id].push(...message.chunk.tokenIds);
    if (id === "cancelled" && !cancelSent) {
      cancelSent = true;
      call.write({ cancel: { requestId: "cancelled" } });
    }
  } else if (kind === "completed") {
    report.finishReasons[id] = message.completed.finishReason;
    report.completionTokens ??= {};
    report.completionTokens[id] = message.completed.usage.completionTokens;
  } else if (kind === "error") {
    report.finishReasons[id] = `error ${message.error.code}: ${message.error.message}`;
  }
  if (kind === "completed" || kind === "error") {
    open.delete(id);
    if (open.size === 0) call.end(); // half-close: no more requests
  }
});

call.on("status", (status) => {
  report.status = { code: status.code, name: grpc.status[status.code], details: status.details };
});

call.on("error", () => {
  // The status event carries the failure; keep the process alive until it arrives.
});

call.on("close", () => {
  process.stdout.write(JSON.stringify(report) + "\n");
  client.close();
  process.exitCode = report.status && report.status.code === grpc.status.OK ? 0 : 1;
});

call.write(generate("kept", 12));
call.write(generate("cancelled", 200));
