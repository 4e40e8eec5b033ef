// subq web view: keeps the tree page live and sends the operator's actions.
// The server renders every piece of HTML; this script only (1) listens to the
// tree's event stream and, on an event, swaps in the tree fragment the server
// renders again, and (2) posts approve / deny / cancel / retry / redeliver after a confirmation,
// showing the server's error when it refuses. No polling: nothing is fetched
// unless the stream says something changed.
"use strict";

(function () {
  const tree = document.getElementById("tree");
  if (!tree) return;
  const live = document.getElementById("live");
  const actionError = document.getElementById("action-error");
  const ui = tree.dataset.fragmentUrl.split("/tasks/")[0];

  function setLive(state, text) {
    live.dataset.state = state;
    live.textContent = text;
  }

  function showError(text) {
    actionError.textContent = text;
    actionError.hidden = !text;
  }

  // -- live refresh: one fetch at a time; events that arrive meanwhile cause one more --
  let fetching = false;
  let again = false;
  let refreshes = 0;

  async function refresh() {
    if (fetching) { again = true; return; }
    fetching = true;
    try {
      do {
        again = false;
        const response = await fetch(tree.dataset.fragmentUrl, { credentials: "same-origin" });
        if (!response.ok) { showError(await errorText(response)); break; }
        swap(await response.text());
        refreshes += 1;
        tree.dataset.refreshes = String(refreshes);
      } while (again);
    } catch (err) {
      showError("Could not refresh the tree: " + err);
    } finally {
      fetching = false;
    }
  }

  // Swap the fragment in, keeping what the operator was typing (feedback), where they were, and
  // which folded groups of a wide fan-out they opened.
  function swap(html) {
    const kept = {};
    tree.querySelectorAll("[data-keep]").forEach((el) => { kept[el.id] = el.value; });
    const opened = [...tree.querySelectorAll("details[data-keep-open][open]")].map((el) => el.id);
    const focused = document.activeElement && document.activeElement.id;
    tree.innerHTML = html;
    for (const [id, value] of Object.entries(kept)) {
      const el = document.getElementById(id);
      if (el) el.value = value;
    }
    for (const id of opened) {
      const el = document.getElementById(id);
      if (el) el.open = true;
    }
    if (focused) { const el = document.getElementById(focused); if (el) el.focus(); }
  }

  // The tree's stream ends once the tree has settled; a retry makes it go on, so the page listens again.
  let stream = null;
  function listen() {
    const source = new EventSource(tree.dataset.eventsUrl);
    stream = source;
    source.onopen = () => setLive("open", "live: updating as the tree's events arrive");
    source.onmessage = () => { refresh(); };
    source.addEventListener("end", (event) => {
      source.close();  // else EventSource reconnects to a stream that has ended
      const status = JSON.parse(event.data).status;
      setLive("ended", "settled (" + status + "): the live stream has ended");
      refresh();
    });
    source.addEventListener("error", (event) => {
      if (event.data) {  // the server's own error event: {code, message, field}
        source.close();
        setLive("failed", "the live stream failed: " + JSON.parse(event.data).message);
      } else if (source.readyState === EventSource.CONNECTING) {
        setLive("reconnecting", "reconnecting to the live stream…");
      } else if (source.readyState === EventSource.CLOSED) {
        setLive("failed", "the live stream closed; reload the page to reconnect");
      }
    });
  }
  listen();

  // -- actions --------------------------------------------------------------------
  async function errorText(response) {
    try {
      const body = await response.json();
      return "Refused (" + response.status + " " + body.code + "): " + body.message;
    } catch (err) {
      return "Refused: HTTP " + response.status;
    }
  }

  async function post(url, body, wakes) {
    showError("");
    const response = await fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!response.ok) { showError(await errorText(response)); return; }
    // A retried tree runs again: listen again if its stream had ended.
    if (wakes && stream.readyState === EventSource.CLOSED) listen();
    refresh();
  }

  tree.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    // Only a person's click acts: a click made by script (event.isTrusted false) never does.
    if (!button || !event.isTrusted) return;
    const action = button.dataset.action;
    if (action === "cancel") {
      const id = button.dataset.taskId;
      const reason = window.prompt("Cancel task " + id + " and its whole subtree?\nReason:", "cancelled from the web view");
      if (reason === null) return;
      post(ui + "/actions/tasks/" + encodeURIComponent(id) + "/cancel", { reason: reason });
    } else if (action === "retry") {
      const id = button.dataset.taskId;
      const tree = button.dataset.tree === "true";
      const question = tree
        ? "Retry task " + id + " and every failed task below it (children first), from their conversations?"
        : "Retry task " + id + " from its conversation? Its finished tool calls are not run again.";
      if (!window.confirm(question)) return;
      post(ui + "/actions/tasks/" + encodeURIComponent(id) + "/retry", { failed: tree }, true);
    } else if (action === "redeliver") {
      const id = button.dataset.taskId;
      const delivery = button.dataset.deliveryId;
      if (!window.confirm("Send " + button.dataset.type + " (" + delivery + ") again now, with the same webhook-id?")) return;
      post(ui + "/actions/tasks/" + encodeURIComponent(id) + "/deliveries/" + encodeURIComponent(delivery) + "/redeliver", {});
    } else if (action === "approve" || action === "deny") {
      const id = button.dataset.approvalId;
      const feedback = (document.getElementById("feedback-" + id) || {}).value || "";
      // The call exactly as the box shows it (server-rendered text, read as text, never as HTML).
      const call = document.getElementById("call-" + id);
      const what = call ? call.textContent : "tool call " + id;
      const question = (action === "approve" ? "Approve " : "Deny ") + what + "?"
        + (action === "deny" && feedback ? "\nFeedback: " + feedback : "");
      if (!window.confirm(question)) return;
      const body = { decision: action };
      if (feedback) body.feedback = feedback;
      post(ui + "/actions/approvals/" + encodeURIComponent(id), body);
    }
  });
})();
