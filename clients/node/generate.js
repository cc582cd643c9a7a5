#!/usr/bin/env node
'use strict';
// pagedserve-generate: stream one request and print each response as a JSON
// line ({"token_ids", "text", "finish_reason"} of output 0), then a summary line
// {"summary": {...}}. Exit code 1 with the gRPC status on stderr on failure.
//
//   node generate.js --addr 127.0.0.1:50051 --prompt "Hello" --max-tokens 16 --temperature 0
const fs = require('fs');
const { GenerationClient } = require('./index');

function parseArgs(argv) {
  const out = { addr: '127.0.0.1:50051', stop: [] };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i].replace(/^--/, '').replace(/-/g, '_');
    const val = argv[++i];
    if (key === 'stop') out.stop.push(val);
    else out[key] = val;
  }
  return out;
}

async function main() {
  const a = parseArgs(process.argv.slice(2));
  const client = new GenerationClient(a.addr, {
    apiKey: a.api_key || process.env.PAGEDSERVE_API_KEY,
    rootCert: a.ca ? fs.readFileSync(a.ca) : undefined,
  });
  const sampling = {};
  if (a.max_tokens !== undefined) sampling.max_tokens = Number(a.max_tokens);
  if (a.temperature !== undefined) sampling.temperature = Number(a.temperature);
  if (a.seed !== undefined) sampling.seed = String(a.seed);
  if (a.stop.length) sampling.stop = a.stop;
  const prompt = a.prompt_ids !== undefined ? a.prompt_ids.split(',').map(Number) : a.prompt;
  try {
    const { outputs, usage } = await client.generate(prompt, sampling, {
      onResponse: (resp) => {
        const o = resp.outputs.find((x) => x.index === 0);
        if (o) {
          console.log(JSON.stringify({ token_ids: o.token_ids, text: o.text, finish_reason: o.finish_reason }));
        }
      },
    });
    console.log(JSON.stringify({ summary: { outputs, usage } }));
  } catch (err) {
    console.error(`error: ${err.code} ${err.details || err.message}`);
    process.exitCode = 1;
  } finally {
    client.close();
  }
}

main();
