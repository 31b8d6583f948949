"""stare.eval.extraction (eval/extraction.py): the answer in a response (``extract_boxed``), the gold answer as bare
LaTeX (``gold_latex``) and the box command the tool loop tests for (``BOX_COMMAND``), against hand-worked cases.
Whether two answers are equal (math-verify) is tests/test_scoring.py's."""
import pytest

from stare.eval.extraction import BOX_COMMAND, extract_boxed, gold_latex


@pytest.mark.parametrize(
    "text,boxed",
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"a \boxed{1} b \fbox{2} c", "2"),
        (r"\boxed{\boxed{5}}", r"\boxed{5}"),  # a box inside a box belongs to the outer one
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are not grouping braces
        (r"\boxed {7}", "7"),
        (r"\boxed 42$.", "42"),
        (r"\boxed{7} \boxed{8", "7"),
        (r"\boxedx{1}", None),
        ("no answer", None),
        (None, None),
    ],
)
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize("text, boxed", [
    (r"\boxed{a\\}b}", r"a\\"),  # an escaped backslash: the brace after it closes the box
    (r"\boxed{\{1}", r"\{1"),  # an escaped brace opens no group ...
    (r"\boxed{a\}}", r"a\}"),  # ... and closes none
    (r"\boxed 42.", "42"),  # a brace-less box: the next token, without the sentence's full stop
    (r"\boxed  x,", "x"),  # ... or comma, after any spaces
    (r"\boxed{ 7 }", "7"),  # the content stripped
    (r"\boxed{1} \boxed{\frac{2}{3}", "1"),  # a truncated last box (nested braces unclosed) is ignored
    (r"\fbox{a}\boxed{b}", "b"),  # the last box, whichever command
    ("\\boxed{x} \\boxed", "x"),  # a bare command at the end is no box
    (r"$\boxed{\text{yes}}$", r"\text{yes}"),
])
def test_extract_boxed_hand_cases(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize("gold, latex", [
    (33, "33"),  # a Python number is its string
    (0.5, "0.5"),
    (True, None),  # a bool is not a number here
    (None, None),
    ([1], None),
    (r"\boxed{12}", "12"),  # a boxed gold: its content
    (r" $\frac{1}{2}$ ", r"\frac{1}{2}"),  # spaces and $...$ stripped
    ("$$x$$", "x"),
    ("$ $", None),  # nothing left
    ("  ", None),
])
def test_gold_latex_hand_cases(gold, latex):
    assert gold_latex(gold) == latex


def test_box_command_matches_the_two_commands_only():
    text = r"\boxed{1} \fbox{2} \boxedx{3} \fboxes \boxed 4 \mbox{5}"
    assert [m.start() for m in BOX_COMMAND.finditer(text)] == [text.index(r"\boxed{1}"), text.index(r"\fbox{2}"),
                                                               text.index(r"\boxed 4")]
