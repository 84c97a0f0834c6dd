"""The baseline a user would otherwise write: transformers' generate() behind a plain Flask app.

Same model and weights as `pagedserve serve` (the default GGUF, dequantized to float32 by
transformers), one request at a time under a lock, no batching, no streaming. It answers

  POST /v1/completions   OpenAI's completion shape with usage (max_tokens, temperature,
                         ignore_eos; non-streaming)
  GET  /v1/models        the one model
  GET  /health           200 once the model is loaded (the app only starts then)

    python benchmarks/naive_server.py --port 8001
"""

from __future__ import annotations

import argparse
import copy
import logging
import threading
import time
import uuid

import torch
from flask import Flask, jsonify, request
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.models.loader import ModelSource, default_model_path, from_pretrained_args


def load(model_path: str):
    source = ModelSource.resolve(model_path)
    directory, kwargs = from_pretrained_args(source)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    return source.name, tokenizer, model.eval()


def create_app(model_name: str, tokenizer, model) -> Flask:
    app = Flask(__name__)
    lock = threading.Lock()  # one generate() at a time: the naive server's defining trait
    created = int(time.time())
    eos = model.generation_config.eos_token_id
    # generate() fills fields left at their defaults (eos None among them) from the model's own
    # config, so EOS is removed there and put back per request unless ignore_eos.
    model.generation_config.eos_token_id = None
    base_config = copy.deepcopy(model.generation_config)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    base_config.pad_token_id = 0 if pad is None else pad

    def error(status: int, message: str):
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
        return jsonify(body), status

    @app.get("/health")
    def health():
        return jsonify({"status": "ok"})

    @app.get("/v1/models")
    def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "naive"}
        return jsonify({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    def completions():
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        if body.get("stream"):
            return error(400, "streaming is not supported by this server")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return error(400, "prompt must be one string")
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature") or 0.0)
        config = copy.deepcopy(base_config)
        config.max_new_tokens = max_tokens
        config.do_sample = temperature > 0
        if temperature > 0:
            config.temperature = temperature
        if not body.get("ignore_eos"):
            config.eos_token_id = eos

        ids = tokenizer(prompt, return_tensors="pt")
        with lock, torch.inference_mode():
            out = model.generate(**ids, generation_config=config)
        new = out[0, ids.input_ids.shape[1] :].tolist()
        n_prompt = ids.input_ids.shape[1]
        return jsonify(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": tokenizer.decode(new, skip_special_tokens=True),
                        "logprobs": None,
                        "finish_reason": "length" if len(new) >= max_tokens else "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": len(new),
                    "total_tokens": n_prompt + len(new),
                },
            }
        )

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    args = parser.parse_args()
    model_name, tokenizer, model = load(args.model or default_model_path())
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    print(f"naive server: {model_name} (float32) on http://{args.host}:{args.port}", flush=True)
    create_app(model_name, tokenizer, model).run(host=args.host, port=args.port, threaded=True)


if __name__ == "__main__":
    main()
