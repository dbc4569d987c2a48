"""The built-in engine's recorded MoE routes (routing replay's source): recording changes no token, and each
recorded column holds the experts a teacher-forced forward pass of the whole sequence chooses there."""
import pytest
import torch

from hybridflow.rollout import Generator, SamplingParams
from hybridflow.rollout.routes import RouteLog, moe_layers
from tests.rollout.conftest import PAD, left_padded_prompts, tiny_decoder

STEPS = 10


def _generate(model, record: bool):
    ids, mask = left_padded_prompts(101, lengths=(9, 4, 1, 7))
    generator = Generator(model, PAD, decode="python")
    generator.record_routes = record
    # Keyed sampling, 2 samples a prompt, and stop ids that end rows early (the loop then drops ended rows).
    params = SamplingParams(max_new_tokens=STEPS, n=2, stop_token_ids=tuple(range(1, 9)))
    return generator.generate(ids, mask, params, row_keys=torch.arange(4) * 7 + 1)


def _forward_routes(model, out) -> torch.Tensor:
    """Each layer's top-k experts over the whole prompt + response sequences, one forward [rows, T+R, L, k]."""
    ids = torch.cat([out.prompts, out.responses], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    layers = moe_layers(model)
    for layer in layers:
        layer.routes_out = []
    try:
        model(ids, mask)
        taken = [layer.routes_out[0].view(*ids.shape, -1) for layer in layers]
    finally:
        for layer in layers:
            layer.routes_out = None
    return torch.stack(taken, 2)


def test_recorded_routes_are_the_teacher_forced_routes_and_recording_changes_no_token():
    model = tiny_decoder("qwen3moe-top2")
    plain, recorded = _generate(model, False), _generate(model, True)
    assert plain.routes is None
    for field in ("responses", "response_mask", "log_probs"):
        assert torch.equal(getattr(plain, field), getattr(recorded, field)), field
    routes = recorded.routes
    rows, t, r = recorded.prompts.shape[0], recorded.prompts.shape[1], recorded.responses.shape[1]
    assert routes.shape == (rows, t + r, 2, 2) and routes.dtype == torch.int16
    mask = torch.cat([recorded.prompt_mask, recorded.response_mask], 1).bool()
    last = t + recorded.response_mask.sum(1) - 1  # each row's last token: sampled, never fed
    fed = mask.clone()
    assert (routes[~mask] == -1).all()  # padding: nothing routed
    want = _forward_routes(model, recorded)
    # A row's last token is fed to the model only when the loop goes on with its row still in the batch.
    at_last = routes[torch.arange(rows), last]
    unfed = (at_last == -1).all(-1).all(-1)
    assert unfed.any() and (at_last[unfed] == -1).all()
    fed[torch.arange(rows), last] = ~unfed
    # Cached decode and one full forward compute the router's logits in other orders (last bits): a top-k
    # near a tie could differ. None does here; every routed column is compared as a set of experts.
    got_sets, want_sets = routes.long().sort(-1).values, want.sort(-1).values
    assert torch.equal(got_sets[fed], want_sets[fed])
    assert fed[:, t:].sum() > 10  # responses were generated and compared, not only prompts


def test_a_dense_model_has_no_routes_to_record():
    with pytest.raises(ValueError, match="dense"):
        RouteLog(tiny_decoder("llama-gqa"), 2, 4, 4)
