"""``GET|POST /api/v1/dev_key/skills``: the calling key reads or sets its own skills."""
from __future__ import annotations

import json

from extproc.app.handlers import Authenticated
from extproc.app.outcomes import Outcome, Reply, RequestHead
from extproc.domain.auth import Principal
from extproc.domain.skills import resolve
from extproc.state.skill_modes import SKILLS

__all__ = ["DevKeySkills"]


class DevKeySkills(Authenticated):
    """``GET|POST /api/v1/dev_key/skills``: read or set the calling key's skills."""

    methods = ("GET", "POST")

    def after_auth(self, head: RequestHead) -> Outcome:
        if head.method == "GET":
            return self._answer(self.principal)
        return super().after_auth(head)

    def on_request_body(self, body: bytes) -> Outcome:
        snap = self.gw.store.set_key_skills(self.principal.key.sha256, self.skills_write(body))
        return self._answer(self.current(snap))

    def _answer(self, p: Principal) -> Reply:
        snap = self.gw.store.snapshot
        effective = resolve(p.key.skills, p.tenant.skills, snap.default_skills)
        out = {"key": p.key.name, "tenant": p.tenant.id,
               "skills": {s: p.key.skills[s] for s in SKILLS if s in p.key.skills},
               "effective": effective}
        return Reply(200, json.dumps(out).encode())
