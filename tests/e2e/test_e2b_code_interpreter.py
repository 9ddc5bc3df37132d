# SPDX-License-Identifier: AGPL-3.0-only
"""`e2b-code-interpreter`, the released package, unmodified, against the gateway: its
`code-interpreter-v1` template is OpenDsec's root/code-interpreter image, whose start command
serves E2B's code-interpreter protocol on port 49999 in every new sandbox."""

import pytest

from test_e2b import e2b, pip_pinned  # noqa: F401  (the fixture: e2b pinned, e2b.env in the environment)

CI_VERSION = "2.11.5"
TEMPLATES = [pytest.param("code-interpreter-v1", id="container"),
             pytest.param("code-interpreter-v1-vm", id="vm")]


@pytest.fixture(scope="module")
def ci(e2b):  # noqa: F811
    pip_pinned("e2b-code-interpreter", CI_VERSION)
    import e2b_code_interpreter

    return e2b_code_interpreter


@pytest.mark.parametrize("template", TEMPLATES)
def test_run_code(ci, e2b, template):  # noqa: F811
    sb = ci.Sandbox.create(template, timeout=120)
    try:
        ex = sb.run_code("x = 20\nx + 1")
        assert ex.text == "21" and ex.error is None
        # the context keeps its state
        assert sb.run_code("x * 2").text == "40"
        out = []
        ex = sb.run_code("print('one')\nimport sys\nprint('two', file=sys.stderr)",
                         on_stdout=lambda m: out.append(m.line))
        assert ex.logs.stdout == ["one\n"] and ex.logs.stderr == ["two\n"]
        assert out == ["one\n"]
        ex = sb.run_code("1 / 0")
        assert ex.error.name == "ZeroDivisionError" and "division by zero" in ex.error.value
        assert sb.run_code("import os; os.environ['ONLY_HERE']", envs={"ONLY_HERE": "v"}).text == "'v'"
        assert sb.run_code("import os; os.environ.get('ONLY_HERE')").text is None
        # contexts of their own
        ctx = sb.create_code_context(cwd="/tmp")
        assert sb.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
        assert sb.run_code("'x' in globals()", context=ctx).text == "False"
        assert ctx.id in [c.id for c in sb.list_code_contexts()]
        sb.restart_code_context(ctx)
        sb.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in sb.list_code_contexts()]
        with pytest.raises(e2b.SandboxException, match="language 'r' is not supported"):
            sb.run_code("1", language="r")
        # it is an ordinary sandbox too
        assert sb.commands.run("echo plain").stdout == "plain\n"
        assert sb.run_code("open('/tmp/from-code.txt', 'w').write('hi')").text == "2"
        assert sb.files.read("/tmp/from-code.txt") == "hi"
    finally:
        sb.kill()


@pytest.mark.parametrize("template", TEMPLATES)
def test_matplotlib_figures_come_back_as_png_and_chart(ci, e2b, template):  # noqa: F811
    import base64

    sb = ci.Sandbox.create(template, timeout=120)
    try:
        ex = sb.run_code(
            "import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [4, 5, 6], label='loss')\n"
            "plt.title('training'); plt.xlabel('step'); plt.ylabel('value')\n"
            "plt.show()")
        assert ex.error is None, ex.error
        assert len(ex.results) == 1, ex.results
        r = ex.results[0]
        assert base64.b64decode(r.png)[:8] == b"\x89PNG\r\n\x1a\n"
        c = r.chart
        assert isinstance(c, ci.charts.LineChart), c
        assert (c.title, c.x_label, c.y_label) == ("training", "step", "value")
        assert [(e.label, e.points) for e in c.elements] == [("loss", [(1, 4), (2, 5), (3, 6)])]
        ex = sb.run_code("import matplotlib.pyplot as plt\n"
                         "plt.bar(['a', 'b'], [3, 1]); plt.show()\n"
                         "plt.pie([1, 3], labels=['x', 'y']); plt.show()")
        bar, pie = ex.results[0].chart, ex.results[1].chart
        assert [(e.label, e.value) for e in bar.elements] == [("a", 3), ("b", 1)], bar.elements
        assert [e.label for e in pie.elements] == ["x", "y"]
        assert [round(e.angle) for e in pie.elements] == [90, 270]
        # A figure is shown once: the next execution has none.
        assert sb.run_code("1 + 1").results[0].text == "2"
        assert len(sb.run_code("1 + 1").results) == 1
    finally:
        sb.kill()


def test_a_start_command_that_never_gets_ready_fails_the_create(e2b, tmp_path):  # noqa: F811
    """An image's [start] command must become ready; otherwise create fails, says why, and
    leaves no sandbox behind."""
    from conftest import DATA, dsec

    spec = tmp_path / "never.toml"
    spec.write_text('name = "root/never-ready:latest"\nfrom = "root/py:3.11"\n'
                    '[start]\nrun = "sleep 1000"\nready = "echo not yet; exit 1"\n'
                    'ready_timeout_seconds = 1\n')
    dsec("image", "build", str(spec), "--data-dir", str(DATA))
    before = {s.sandbox_id for s in e2b.Sandbox.list().next_items()}
    with pytest.raises(e2b.SandboxException, match="was not ready within 1 s.*not yet"):
        e2b.Sandbox.create("root/never-ready:latest")
    assert {s.sandbox_id for s in e2b.Sandbox.list().next_items()} == before
