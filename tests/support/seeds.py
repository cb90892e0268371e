"""The seeds' request shapes, verbatim: what a client written against the seeds' examples sends."""

# the hint fields a seeds client puts in ``extra_body`` (gateway-owned: never trusted)
SEED_HINTS = {"lora_name": "code-python", "enable_lora_prefetch": True,
              "prefetch_adapter_id": "code-python", "vram_allocated_mb": 420, "prefetch_status": "hit"}
# the seeds' /v1/execute body, skills in the object form
SEED_EXECUTE = {"input": {"messages": [{"role": "user", "content": "Write a python function"}]},
                "target": {"model": "ace-tiny-llama"},
                "skill_overrides": {"multi_lora": {"mode": "prod"},
                                    "dynamic_lora_prefetch": {"mode": "shadow"}},
                "extra_body": SEED_HINTS}
