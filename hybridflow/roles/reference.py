"""The reference role: log-probs of the frozen initial policy, for KL."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridflow.config.schema import ReferenceConfig
from hybridflow.data import fields as F
from hybridflow.roles.batching import forward_only, response_log_probs


class Reference:
    def __init__(self, cfg: ReferenceConfig, engine, *, temperature: float = 1.0):
        if engine.optimizer is not None:
            raise ValueError("the reference policy needs a frozen engine (built with optim=None)")
        self.cfg, self.engine = cfg, engine
        self.temperature = temperature

    @torch.no_grad()
    def compute_ref_log_probs(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """REF_LOG_PROBS [B, R]."""
        def collect(out, mb):
            logp, _ = response_log_probs(out, mb, self.engine, self.temperature)
            return {F.REF_LOG_PROBS: logp.float()}
        cfg = self.cfg
        return forward_only(self.engine, batch, cfg.log_prob_micro_batch_size, collect,
                            cfg.log_prob_max_token_len_per_gpu if cfg.log_prob_use_dynamic_bsz else 0,
                            cfg.log_prob_share_prompts)
