"""dynshard's replacements of torch attributes are held while any compile needs them and undone after,
and its compiles keep a user's own Inductor passes."""

from __future__ import annotations

from dynshard.compat.counted_patch import CountedPatch
from dynshard.backend.compiler.inductor_compile import _DYNSHARD_COMPILE, _marked_dynshards


class Owner:
    def method(self):
        return "torch's"


def test_a_patch_is_held_until_the_last_context_exits_and_restored_unless_replaced_since():
    patch = CountedPatch(lambda: Owner, "method", lambda original: lambda self: "dynshard's, then " + original(self))
    with patch.applied():
        with patch.applied():
            assert Owner().method() == "dynshard's, then torch's"
        assert Owner().method() == "dynshard's, then torch's"
    assert Owner().method() == "torch's"

    def someone_elses(self):
        return "someone else's"
    with patch.applied():
        Owner.method = someone_elses
    assert Owner.method is someone_elses


def test_dynshards_compiles_run_the_users_post_grad_passes_then_mark_their_cache_entries():
    def user_pass(graph):
        return None
    assert _marked_dynshards(None) is _DYNSHARD_COMPILE
    assert _marked_dynshards(user_pass) == [user_pass, _DYNSHARD_COMPILE]
    assert _marked_dynshards([user_pass, user_pass]) == [user_pass, user_pass, _DYNSHARD_COMPILE]
