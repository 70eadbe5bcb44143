"""Settings → API tokens: create (the secret is shown on that one answer only), list and revoke."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from forgeboard.accounts.models import TokenScope
from forgeboard.accounts.selectors import api_token_get, api_tokens_for_user, projects_where_user_may_create_tokens
from forgeboard.accounts.services import api_token_create, api_token_revoke
from forgeboard.errors import NotFound, ServiceError, ValidationFailed
from forgeboard.web.errors import project_or_404, refusal_or_flash

EXPIRY_CHOICES = [("30", "30 days"), ("90", "90 days"), ("365", "1 year"), ("7", "7 days"), ("", "never")]


def _page(request: HttpRequest, *, created: tuple | None = None, status: int = 200) -> HttpResponse:
    now = timezone.now()
    tokens = [(t, t.revoked_at is None and (t.expires_at is None or t.expires_at > now))
              for t in api_tokens_for_user(user=request.user)]
    return render(request, "web/tokens.html", {
        "tokens": tokens, "projects": projects_where_user_may_create_tokens(user=request.user),
        "scopes": TokenScope.choices, "expiries": EXPIRY_CHOICES, "created": created,
    }, status=status)


def _expiry(value: str):  # noqa: ANN202 - a datetime or None
    if value == "":
        return None
    if value not in {days for days, _ in EXPIRY_CHOICES}:
        raise ValidationFailed.on("expires", "choose one of the offered lifetimes")
    return timezone.now() + timedelta(days=int(value))


@never_cache
@login_required
@require_http_methods(["GET", "POST"])
def tokens(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return _page(request)
    project = project_or_404(request, request.POST.get("project", ""))
    try:
        token, raw = api_token_create(actor=request.user, project=project, name=request.POST.get("name", ""),
                                      scope=request.POST.get("scope", ""),
                                      expires_at=_expiry(request.POST.get("expires", "")))
    except ServiceError as error:
        if refused := refusal_or_flash(request, error):
            return refused
        return _page(request, status=error.status)
    # Answered here, not after a redirect: the secret is in this response only, stored nowhere.
    return _page(request, created=(token, raw))


@login_required
@require_POST
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    try:
        token = api_token_get(actor=request.user, token_id=token_id)
    except NotFound:
        raise Http404("no such token") from None
    try:
        api_token_revoke(actor=request.user, token=token)
    except ServiceError as error:
        if refused := refusal_or_flash(request, error):
            return refused
    else:
        messages.success(request, f"token {token.name} (fb_{token.prefix}_…) revoked")
    return redirect("settings_tokens")
