// A unary Generate client written with @grpc/grpc-js and @grpc/proto-loader that asks for shaped
// output: one request per kind of response format (JSON Schema, regex, choice).
//
// Usage: node tests/interop/response_format.cjs HOST:PORT
//
// Prints one JSON object: for each kind, the response's text and finish reason, or the error's
// code and details for a format the server refuses. Exit code 0 when every call returned.
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
const client = new tokenwire.InferenceService(process.argv[2], grpc.credentials.createInsecure());

const schema = {
  type: "object",
  properties: { ok: { type: "boolean" }, n: { type: "integer", minimum: 0, maximum: 99 } },
  required: ["ok", "n"],
  additionalProperties: false,
};
const formats = {
  jsonSchema: { jsonSchema: JSON.stringify(schema) },
  regex: { regex: "[a-f]{3}-[0-9]{2}" },
  choice: { choice: { options: ["left", "right"] } },
  badRegex: { regex: "(" },
};

function generate(responseFormat) {
  return new Promise((resolve) => {
    const request = {
      prompt: "Answer:",
      sampling: { temperature: 1, seed: "11" },
      stopping: { maxNewTokens: 100 },
      responseFormat,
    };
    client.Generate(request, { deadline: new Date(Date.now() + 60_000) }, (error, response) => {
      if (error) {
        resolve({ code: error.code, details: error.details });
      } else {
        resolve({ text: response.text, finishReason: response.finishReason });
      }
    });
  });
}

(async () => {
  const report = {};
  for (const [name, format] of Object.entries(formats)) {
    report[name] = await generate(format);
  }
  process.stdout.write(JSON.stringify(report));
  client.close();
})();
