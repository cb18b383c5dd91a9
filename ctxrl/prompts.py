"""The words ctxrl itself writes into conversations, in one place.

Context managers, the meta loop and annealed demonstrations add text the environment did not
write: a request for a summary, the header a summary is restarted under, the note from earlier
attempts. The instructions and headers are constants here, so that the configuration can name the
defaults without importing rollout code. Text formatted from values is written where the values
are: the meta loop's feedback line and attempt header (``ctxrl.meta.rollout``), ``fold``'s error
observations (``ctxrl.rollout.managers.fold``), a demonstration's layout (``ctxrl.meta.demos``).
The instructions are configurable (``context.summarize.instruction``, ``meta.reflection_instruction``);
the headers are fixed, because trained policies learn them.
"""

SUMMARY_INSTRUCTION = ("Your context is nearly full. Write a short summary of what you have found and what is "
                       "left to do; you will continue from it.")
"""The user message that asks for a summary (``summarize``)."""
SUMMARY_HEADER = "\n\nYour summary of the work so far:\n"
"""Appended to the task, before the summary, in the prompt a ``summarize`` segment restarts from."""
SELECT_INSTRUCTION = ("Context full. Earlier turns:\n{turns}\nReply with the numbers of the earlier turns to keep, "
                      "e.g. <keep>1 3</keep>.")
"""The user message that asks which earlier turns to keep (``select``; ``{turns}``: one ``N: call`` line per
turn). Fixed, like the headers: a trained policy learns its numbering and reply format."""
BRANCH_HEADER = "\n\nYour sub-task (work on it, then call return with its result):\n"
"""Appended to the task, before the goal, in the prompt a ``fold`` branch starts from."""
REFLECTION_INSTRUCTION = ("Reflect on this attempt in one or two sentences: what went wrong, and what will you do "
                          "differently next time?")
"""The user message, after the feedback line, that asks for a reflection (the meta loop)."""
NOTES_HEADER = "\n\nNotes from your earlier attempts at this task:\n"
"""Appended to the task, before the notes of earlier attempts (``meta.carry = "reflections"``)."""
DEMOS_HEADER = "Solved examples of similar tasks:"
"""Opens the block of few-shot demonstrations written before the task (annealed demonstrations)."""
TASK_HEADER = "Your task:"
"""Follows the demonstrations, before the task itself."""
