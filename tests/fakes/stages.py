"""Faults a test injects into a pipeline-parallel engine's stages (run on every stage by
`on_all_stages`, so module-level: a stage process imports them by name)."""


def corrupt_last_stage(engine, block: int) -> bool:
    """Add 1 to one value of `block` in the last stage's cache (after a handoff's checksums were
    taken): its layers must fail verification. True on the stage that changed."""
    if not engine.stage.last:
        return False
    engine.kv.storage[0, 1, block].view(-1)[0] += 1.0
    return True


def corrupt_layer(engine, layer: int, block: int) -> None:
    """The same in one engine's cache of every layer: `layer`'s first value of `block`."""
    engine.kv.storage[layer, 1, block].view(-1)[0] += 1.0
