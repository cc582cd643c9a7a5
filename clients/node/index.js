'use strict';
// Node.js client for pagedserve's gRPC API (pagedserve.v1.Generation).
//
//   const { GenerationClient } = require('pagedserve-client');
//   const c = new GenerationClient('127.0.0.1:50051', { apiKey, rootCert });
//   for await (const resp of c.stream({ prompt: 'Hello', sampling_params: { max_tokens: 16 } })) { ... }
//   const { outputs, usage } = await c.generate('Hello', { max_tokens: 16, temperature: 0 });
//
// Field names are the proto's (snake_case): the .proto file is loaded at run
// time, so this client follows the server's API without generated code.
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_PROTO = path.join(__dirname, '..', '..', 'proto', 'pagedserve', 'v1', 'generation.proto');

function loadService(protoPath) {
  const def = protoLoader.loadSync(protoPath || process.env.PAGEDSERVE_PROTO || DEFAULT_PROTO, {
    keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
  });
  return grpc.loadPackageDefinition(def).pagedserve.v1.Generation;
}

function buildRequest(prompt, sampling = {}, extra = {}) {
  const req = { sampling_params: sampling, ...extra };
  if (typeof prompt === 'string') req.prompt = prompt;
  else req.prompt_token_ids = { ids: prompt };
  return req;
}

class GenerationClient {
  constructor(addr = '127.0.0.1:50051', { apiKey, rootCert, protoPath } = {}) {
    const Service = loadService(protoPath);
    const creds = rootCert ? grpc.credentials.createSsl(Buffer.from(rootCert)) : grpc.credentials.createInsecure();
    this.stub = new Service(addr, creds);
    this.metadata = new grpc.Metadata();
    if (apiKey) this.metadata.set('authorization', `Bearer ${apiKey}`);
  }

  close() { this.stub.close(); }

  _options(timeoutMs) {
    return timeoutMs ? { deadline: new Date(Date.now() + timeoutMs) } : {};
  }

  // The server-streaming call: an async-iterable of GenerateResponse (call.cancel() stops it).
  stream(request, { timeoutMs } = {}) {
    return this.stub.Generate(request, this.metadata, this._options(timeoutMs));
  }

  // Collects every output: [{ index, token_ids, text, finish_reason }] plus usage.
  async generate(prompt, sampling = {}, { timeoutMs, onResponse } = {}) {
    const outputs = new Map();
    let usage = null;
    for await (const resp of this.stream(buildRequest(prompt, sampling), { timeoutMs })) {
      if (onResponse) onResponse(resp);
      for (const o of resp.outputs) {
        let acc = outputs.get(o.index);
        if (!acc || o.replace) acc = { index: o.index, token_ids: [], text: '', finish_reason: '' };
        acc.token_ids.push(...o.token_ids);
        acc.text += o.text;
        acc.finish_reason = o.finish_reason || acc.finish_reason;
        outputs.set(o.index, acc);
      }
      if (resp.usage) usage = resp.usage;
    }
    return { outputs: [...outputs.values()].sort((a, b) => a.index - b.index), usage };
  }

  _unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata, (err, resp) => (err ? reject(err) : resolve(resp)));
    });
  }

  modelInfo() { return this._unary('GetModelInfo', {}); }
  serverInfo() { return this._unary('GetServerInfo', {}); }
  async tokenize(text, addSpecialTokens = true) {
    return (await this._unary('Tokenize', { text, add_special_tokens: addSpecialTokens })).token_ids;
  }
  async detokenize(tokenIds) { return (await this._unary('Detokenize', { token_ids: tokenIds })).text; }
  async abort(requestIds) { return (await this._unary('Abort', { request_ids: requestIds })).num_aborted; }
}

module.exports = { GenerationClient, buildRequest, loadService, grpc };
