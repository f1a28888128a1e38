"""The case key of `fp4moe bench` JSON, shared by the scripts that read it."""


def lora_case(c):
    """A case's LoRA case: its "lora_case", or for JSON written before that field (and the torch baseline's), the
    per_expert8 row when "lora" is true and "base" otherwise."""
    return c.get("lora_case") or ("per_expert8" if c.get("lora") else "base")
