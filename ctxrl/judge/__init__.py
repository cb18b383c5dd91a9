"""Model-graded rewards: a judge grades each training episode against a rubric, through any OpenAI-compatible
endpoint (``ctxrl serve`` included) or a model loaded in this process (docs/judges.md).

- ``rubric``: the criteria, weights and scale, the judge's prompt and the parser of its reply;
- ``transcript``: what it reads of an episode (its transcript or final answer);
- ``backends``: where its replies come from (an endpoint, a local model);
- ``cache``: results by the hash of the question, so reruns cost nothing;
- ``spec``: ``JudgeSettings`` (the table ``[reward.judge]``, what a rollout worker reads);
- ``judge``: ``Judge`` (retries, deadlines, errors) and ``JudgeRound``
  (the episodes of a request graded as they finish, beside the ones still playing);
- ``figures``: the score distribution and the agreement with the environment's verifier.
"""

from ctxrl.judge.judge import Judge, JudgeError, JudgeRound
from ctxrl.judge.spec import JudgeSettings

__all__ = ["Judge", "JudgeError", "JudgeRound", "JudgeSettings"]
