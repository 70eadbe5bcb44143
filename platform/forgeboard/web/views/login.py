"""Log in, with a brake on repeated failures per account and per address (api/ratelimit.py; failures are counted
in accounts/backends.py, which also brakes the admin's login)."""

from __future__ import annotations

from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse

from forgeboard.api.ratelimit import login_refusal


class ThrottledLoginView(LoginView):
    """Past too many failures the login is refused (429) before the password is checked, right or wrong."""

    template_name = "web/login.html"

    def post(self, request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        refusal = login_refusal(request, username=request.POST.get("username", ""))
        if refusal:
            context = self.get_context_data(form=self.get_form_class()(request), throttled=refusal)
            return self.render_to_response(context, status=429)
        return super().post(request, *args, **kwargs)
