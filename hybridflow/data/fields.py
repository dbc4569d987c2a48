"""Names of the fields a batch carries through one RL iteration.

Every stage (dataset, rollout, preparation, update) reads and writes batch
entries through these constants, never through string literals, so a typo is
an ``AttributeError`` at import time instead of a silent ``KeyError`` deep in
a worker. Shapes use ``B`` = number of sequences in the batch, ``T`` = padded
prompt length, ``R`` = padded response length.

Prompt stage (produced by :func:`hybridflow.data.dataset.collate_prompts`):

=================  ====================  ==========================================
constant           type / shape          meaning
=================  ====================  ==========================================
INPUT_IDS          LongTensor[B, T]      token ids, LEFT-padded with the pad id.
                                         After rollout: LongTensor[B, T + R],
                                         prompt followed by response.
ATTENTION_MASK     LongTensor[B, T]      1 on real tokens, 0 on padding
                                         ([B, T + R] after rollout).
POSITION_IDS       LongTensor[B, T]      0 at the first real token, counting up;
                                         0 on left padding ([B, T + R] after
                                         rollout).
PROMPT_TEXT        list[str]  (B)        the prompt exactly as tokenized (chat
                                         template applied, after truncation).
RAW_PROMPT         list[list[dict]] (B)  the prompt's chat messages
                                         ``{"role", "content"}`` as read from disk,
                                         for reward models that render their own
                                         template.
DATA_SOURCE        list[str]  (B)        which task the row came from; selects the
                                         reward function (e.g. "openai/gsm8k").
GROUND_TRUTH       list[Any]  (B)        the verifier's reference answer (a str for
                                         the built-in tasks).
EXTRA_INFO         list[dict] (B)        free-form per-row metadata from the dataset.
INDEX              list[int]  (B)        the row's position in the dataset's source
                                         files (stable under filtering/shuffling).
=================  ====================  ==========================================

Rollout and preparation stages:

=================  ====================  ==========================================
PROMPTS            LongTensor[B, T]      the left-padded prompt ids, kept once the
                                         response is appended to INPUT_IDS.
RESPONSES          LongTensor[B, R]      generated ids, RIGHT-padded with the pad id.
RESPONSE_MASK      LongTensor[B, R]      1 on generated tokens (EOS included),
                                         0 on padding after it, and 0 on tool
                                         output and chat-template glue inside a
                                         multi-turn response (rollout/agent.py).
RESPONSE_TEXT      list[str]  (B)        decoded responses (special tokens skipped).
RESPONSE_LENGTH    LongTensor[B]         RESPONSE_MASK's 1s per row: what the driver
                                         reads of a response's tokens (its lengths
                                         and figures), the tensors themselves being
                                         left where they were made (Ray runs).
TRUNCATED          BoolTensor[B]         the response used all data.max_response_length
                                         tokens without ending on a stop token (cut
                                         by the limit; single-turn rollouts).
UID                list[str]  (B)        group id: the n samples of one prompt share
                                         it (GRPO / RLOO baselines).
ROLLOUT_LOG_PROBS  FloatTensor[B, R]     per-token log-probs reported by the
                                         inference engine while sampling.
ROUTES             ShortTensor[B, T+R, L, k] an MoE model's experts chosen per
                                         column of INPUT_IDS and layer while
                                         sampling (built-in engine), -1 where none.
OLD_ROUTES         ShortTensor[B, T+R, L, k] the same, chosen by the old-log-prob
                                         pass (actor.moe.routing_replay=old).
ROUTE_MISMATCH     FloatTensor[B, T+R]   per column, the share of layers where the
                                         trainer's experts differed from ROUTES in
                                         the old pass; -1 where not measured.
WEIGHT_VERSION     LongTensor[B]         the actor's weight version that generated
                                         the row: the number of updates those weights
                                         had taken (trainer.off_policy may lag it).
OLD_LOG_PROBS      FloatTensor[B, R]     per-token log-probs of the actor in its
                                         training layout, before the update.
REF_LOG_PROBS      FloatTensor[B, R]     per-token log-probs of the frozen reference.
ENTROPY            FloatTensor[B, R]     per-token entropy of the actor's policy.
VALUES             FloatTensor[B, R]     critic value estimate per response token.
SCORES             FloatTensor[B]        sequence-level verifier / reward-model score.
BASELINE_SCORES    FloatTensor[B]        ReMax only: the score of the greedy response
                                         to the row's prompt (the same for its n
                                         samples), the baseline of its advantage.
ENV_REWARDS        FloatTensor[B, R]     multi-turn rollouts only: each environment
                                         step's reward on the last token of the
                                         model turn it answers, zeros elsewhere.
ENV_SCORES         FloatTensor[B]        multi-turn rollouts only: ENV_REWARDS summed
                                         over each row.
ENV_STATS          list[dict]            multi-turn rollouts only: per trajectory
                                         its turns, why it ended, and the
                                         environment's own counts (`stats()`).
RULE_SCORES        FloatTensor[B]        the rule-based reward of each response
                                         (reward.function), scored by the rollout.
RULE_REWARD_SECONDS FloatTensor[B]       the seconds the rollout spent in the rule
                                         reward, spread evenly over the rows it
                                         scored (the driver sums and drops it:
                                         timing/rule_reward_s).
REWARD_FAILED      FloatTensor[B]        1.0 on a row whose reward raised, timed out
                                         or returned no number (it scored 0; the
                                         driver sums and drops it: reward/failures).
REWARD_TIMED_OUT   FloatTensor[B]        1.0 on a row whose reward ran past
                                         reward.timeout_s (reward/timeouts).
OUTCOME_SCORES     FloatTensor[B]        the rule (and reward-model) part of SCORES,
                                         which TOKEN_SCORES places on the last token.
TOKEN_SCORES       FloatTensor[B, R]     OUTCOME_SCORES placed on each sequence's
                                         last response token, plus each ENV_REWARDS
                                         turn reward where it lands; zeros elsewhere.
TOKEN_REWARDS      FloatTensor[B, R]     TOKEN_SCORES minus the KL penalty when
                                         KL-in-reward is on (otherwise equal).
ADVANTAGES         FloatTensor[B, R]     advantage estimate per response token.
RETURNS            FloatTensor[B, R]     return targets for the critic.
=================  ====================  ==========================================

``FIELD_SHAPES`` repeats the type/shape column as data, e.g. for validation
messages; it is read-only.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

# Prompt stage.
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
PROMPT_TEXT = "prompt_text"
RAW_PROMPT = "raw_prompt"
DATA_SOURCE = "data_source"
GROUND_TRUTH = "ground_truth"
EXTRA_INFO = "extra_info"
INDEX = "index"

# Rollout and preparation stages.
PROMPTS = "prompts"
RESPONSES = "responses"
RESPONSE_MASK = "response_mask"
RESPONSE_TEXT = "response_text"
RESPONSE_LENGTH = "response_length"
TRUNCATED = "truncated"
UID = "uid"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
ROUTES = "routes"
OLD_ROUTES = "old_routes"
ROUTE_MISMATCH = "route_mismatch"
WEIGHT_VERSION = "weight_version"
OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROBS = "ref_log_probs"
ENTROPY = "entropy"
VALUES = "values"
SCORES = "scores"
BASELINE_SCORES = "baseline_scores"
ENV_REWARDS = "env_rewards"
ENV_SCORES = "env_scores"
ENV_STATS = "env_stats"
OUTCOME_SCORES = "outcome_scores"
RULE_SCORES = "rule_scores"
RULE_REWARD_SECONDS = "rule_reward_seconds"
REWARD_FAILED = "reward_failed"
REWARD_TIMED_OUT = "reward_timed_out"
TOKEN_SCORES = "token_scores"
TOKEN_REWARDS = "token_rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"

FIELD_SHAPES: Mapping[str, str] = MappingProxyType({
    INPUT_IDS: "LongTensor[B, T]",
    ATTENTION_MASK: "LongTensor[B, T]",
    POSITION_IDS: "LongTensor[B, T]",
    PROMPT_TEXT: "list[str]",
    RAW_PROMPT: "list[list[dict]]",
    DATA_SOURCE: "list[str]",
    GROUND_TRUTH: "list[Any]",
    EXTRA_INFO: "list[dict]",
    INDEX: "list[int]",
    PROMPTS: "LongTensor[B, T]",
    RESPONSES: "LongTensor[B, R]",
    RESPONSE_MASK: "LongTensor[B, R]",
    RESPONSE_TEXT: "list[str]",
    RESPONSE_LENGTH: "LongTensor[B]",
    TRUNCATED: "BoolTensor[B]",
    UID: "list[str]",
    ROLLOUT_LOG_PROBS: "FloatTensor[B, R]",
    ROUTES: "ShortTensor[B, T+R, L, k]",
    OLD_ROUTES: "ShortTensor[B, T+R, L, k]",
    ROUTE_MISMATCH: "FloatTensor[B, T+R]",
    WEIGHT_VERSION: "LongTensor[B]",
    OLD_LOG_PROBS: "FloatTensor[B, R]",
    REF_LOG_PROBS: "FloatTensor[B, R]",
    ENTROPY: "FloatTensor[B, R]",
    VALUES: "FloatTensor[B, R]",
    SCORES: "FloatTensor[B]",
    BASELINE_SCORES: "FloatTensor[B]",
    ENV_REWARDS: "FloatTensor[B, R]",
    ENV_SCORES: "FloatTensor[B]",
    ENV_STATS: "list[dict]",
    OUTCOME_SCORES: "FloatTensor[B]",
    RULE_SCORES: "FloatTensor[B]",
    RULE_REWARD_SECONDS: "FloatTensor[B]",
    REWARD_FAILED: "FloatTensor[B]",
    REWARD_TIMED_OUT: "FloatTensor[B]",
    TOKEN_SCORES: "FloatTensor[B, R]",
    TOKEN_REWARDS: "FloatTensor[B, R]",
    ADVANTAGES: "FloatTensor[B, R]",
    RETURNS: "FloatTensor[B, R]",
})

# The tensor fields collate_prompts produces, and the per-row lists beside them.
PROMPT_TENSOR_FIELDS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)
PROMPT_LIST_FIELDS = (PROMPT_TEXT, RAW_PROMPT, DATA_SOURCE, GROUND_TRUTH, EXTRA_INFO, INDEX)
