"""The case key of `fp4moe bench` JSON (shape without its variant, LoRA case), shared by the scripts that read it."""


def lora_case(c):
    """A case's LoRA case: its "lora_case", or for JSON written before that field (and the torch baseline's), the
    per_expert8 row when "lora" is true and "base" otherwise."""
    return c.get("lora_case") or ("per_expert8" if c.get("lora") else "base")


def shape_of(c):
    """A case's model shape without its variant suffix ("kimi_k3_tp8+situ" is "kimi_k3_tp8")."""
    return c["shape"].split("+")[0]
