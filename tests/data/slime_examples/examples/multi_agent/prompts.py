"""Prompts of the multi-agent re-creation (slime's examples/multi_agent/prompts.py, shortened)."""

SOLVER_PROMPT_TEMPLATE = (
    "Solve the problem. Think, then close with </think> and give the answer.\n{problem_statement}\n"
)


def generate_rewriter_template(num_solutions: int) -> str:
    parts = [f"Solution {i + 1}:\n{{solution{i + 1}}}\n" for i in range(num_solutions)]
    return "Problem:\n{problem_statement}\n" + "".join(parts) + "Write one better solution.\n"


def generate_select_template(num_solutions: int) -> str:
    parts = [f"Solution {i + 1}:\n{{solution{i + 1}}}\n" for i in range(num_solutions)]
    return "Problem:\n{problem_statement}\n" + "".join(parts) + "Pick the best; end with 'Judgment: N'.\n"
