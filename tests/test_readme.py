"""The README starts with the two set-up commands and shows what the reports say."""
from tools.report_tables import BEGIN, END, REPO, render

README = (REPO / "README.md").read_text()


def test_two_commands_at_the_top():
    top = README[:600]
    assert "make demo" in top and "make test" in top


def test_numbers_section_is_rendered_from_the_committed_reports():
    section = README.split(BEGIN, 1)[1].split(END, 1)[0]
    assert section.strip() == render().strip(), "run: python -m tools.report_tables --update"


def test_every_linked_doc_and_image_exists():
    import re
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (REPO / target).exists(), target
