from django.contrib.auth import views as auth_views
from django.urls import path

from forgeboard.web.views import artifacts, cluster, compare, launch, pages, runs, suites, tokens
from forgeboard.web.views.login import ThrottledLoginView

urlpatterns = [
    path("healthz", pages.healthz, name="healthz"),
    path("login/", ThrottledLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", pages.home, name="home"),
    path("p/<slug:slug>/", runs.run_list, name="project_detail"),
    path("p/<slug:slug>/members/", pages.members, name="project_members"),
    path("p/<slug:slug>/artifacts/", artifacts.artifacts, name="project_artifacts"),
    path("p/<slug:slug>/launch/", launch.launch, name="launch"),
    path("p/<slug:slug>/compare/", compare.compare, name="compare"),
    path("p/<slug:slug>/suites/", suites.suites, name="project_suites"),
    path("p/<slug:slug>/suites/<str:name>/", suites.suite_detail, name="suite_detail"),
    path("runs/<int:run_id>/", runs.run_detail, name="run_detail"),
    path("runs/<int:run_id>/rollouts/", runs.run_rollouts, name="run_rollouts"),
    path("runs/<int:run_id>/checkpoints/", runs.run_checkpoints_part, name="run_checkpoints"),
    path("runs/<int:run_id>/cancel/", runs.run_cancel_view, name="run_cancel"),
    path("runs/<int:run_id>/commands/", runs.run_command, name="run_command"),
    path("runs/<int:run_id>/checkpoints/<int:step>/launch/", runs.run_from_checkpoint, name="run_from_checkpoint"),
    path("runs/<int:run_id>/clone/", launch.clone, name="run_clone"),
    path("runs/<int:run_id>/checkpoints/<int:step>/new/", launch.from_checkpoint, name="run_from_checkpoint_form"),
    path("cluster/", cluster.cluster, name="cluster"),
    path("settings/tokens/", tokens.tokens, name="settings_tokens"),
    path("settings/tokens/<int:token_id>/revoke/", tokens.token_revoke, name="settings_token_revoke"),
]
