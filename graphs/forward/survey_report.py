"""The surveys' report loop, shared by survey.py (torch) and survey_keras.py (Keras), which run
in different venvs: no imports beyond the standard library."""

import tempfile


def report_each(names, survey):
    """One line per model: `survey(name, workdir)`'s findings, or what stopped it (a failed
    export is a finding too)."""
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            try:
                print(f"{name}: {survey(name, workdir)}", flush=True)
            except Exception as e:
                print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
