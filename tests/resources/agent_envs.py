"""Agent tools, a tool format and an environment for the agent pipeline tests."""

from rlgraph.ops.agents import Environment, Inline, tool


class Parens(Inline):
    """[name text] written with parentheses, which the default character vocabulary has."""

    open, close = "(", ")"


@tool(timeout_s=2.0)
def calc(expression: str) -> str:
    """Evaluate a sum of integers."""
    return str(sum(int(x) for x in expression.split("+")))


class GuessNumber(Environment):
    """Guess the row's ground truth: 'higher' or 'lower' after each wrong guess; reward 1 when right."""

    def reset(self, row):
        self.target = int(row["ground_truth"])
        return ""

    def step(self, action):
        digits = "".join(c for c in action if c.isdigit())
        if not digits:
            return "number?", 0.0, False, {}
        guess = int(digits[:4])
        if guess == self.target:
            return "", 1.0, True, {}
        return ("higher" if guess < self.target else "lower"), 0.0, False, {}
