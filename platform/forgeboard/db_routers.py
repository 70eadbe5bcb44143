from channels_lite.router import ChannelsRouter


class EmbeddedChannelsRouter(ChannelsRouter):
    """The SQLite channel layer's tables live alone in the `channels` database; everything else in default."""

    def allow_migrate(self, db, app_label, model_name=None, **hints):  # noqa: ANN001
        if app_label in self.route_app_labels:
            return db == self.database
        return db == "default"
