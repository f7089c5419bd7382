"""The request-path sequence diagram: its arrows follow the request's real times, one per hop, the
first tokens and the last shown, and times that do not follow the path are refused by name."""
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from infra_lab.diagrams import request_path
from infra_lab.figures import MIN_FONT_PT


def a_path(tokens: int = 6) -> request_path.RequestPath:
    token_s = tuple(0.010 + 0.002 * i for i in range(tokens))
    return request_path.RequestPath(sent_s=0.0, submitted_s=0.001, admitted_s=0.002, token_s=token_s,
                                    chunk_s=tuple(t + 0.0005 for t in token_s), done_s=token_s[-1] + 0.001)


def test_messages_follow_the_path_in_time():
    path = a_path()
    arrows = request_path.messages(path, shown=3)
    assert [a[4] for a in arrows] == ["POST /v1/completions", "submit: waits for the next step",
                                      "prefill: the prompt, token 1", "token 1: one event", "token 2: one event",
                                      "token 3: one event", "token 6: one event", "data: [DONE]"]
    for source, target, start_s, stop_s, _ in arrows:
        assert source in request_path.LANES and target in request_path.LANES and start_s <= stop_s


def test_a_short_request_shows_each_token_once():
    labels = [a[4] for a in request_path.messages(a_path(2), shown=3)]
    assert labels.count("token 1: one event") == 1 and labels.count("token 2: one event") == 1


def test_the_figure_draws_every_lane_and_arrow_legibly():
    figure = request_path.draw(a_path())
    FigureCanvasAgg(figure).draw()
    ax = figure.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert all(lane in texts for lane in request_path.LANES)
    assert sum("one event" in t for t in texts) == 4
    assert min(t.get_fontsize() for t in ax.texts) >= MIN_FONT_PT
    assert ax.yaxis_inverted()  # time flows down


@pytest.mark.parametrize("change, named", [
    ({"token_s": (), "chunk_s": ()}, "one client chunk per engine token"),
    ({"chunk_s": (0.5,)}, "one client chunk per engine token"),
    ({"admitted_s": 0.0005}, "follow the request's path"),
])
def test_times_off_the_path_are_refused(change, named):
    fields = {"sent_s": 0.0, "submitted_s": 0.001, "admitted_s": 0.002, "token_s": (0.01, 0.02),
              "chunk_s": (0.011, 0.021), "done_s": 0.03} | change
    with pytest.raises(ValueError, match=named):
        request_path.RequestPath(**fields)
