from django.contrib.auth import views as auth_views
from django.urls import path

from forgeboard.web import views

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    path("login/", auth_views.LoginView.as_view(template_name="web/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.home, name="home"),
    path("p/<slug:slug>/", views.project_detail, name="project_detail"),
]
