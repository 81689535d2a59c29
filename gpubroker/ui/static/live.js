// gpubroker's live pages: one event stream per browser, shared by its tabs.
//
// Browsers allow six connections per host, so a seventh tab must not open a seventh
// stream. The tabs elect a leader with a Web Lock (held until the tab closes, then
// granted to the next tab waiting for it); the leader holds the only EventSource and
// rebroadcasts each message on a BroadcastChannel; the others listen. A new leader
// resumes after the last id any tab saw. On a message the page fetches its own
// live region again (/fragment/<page>) — once per burst, never per row, never on a timer.
(() => {
  "use strict";
  const main = document.getElementById("live");
  const badge = document.getElementById("live-state");
  const types = (document.body.dataset.events || "").split(" ").filter(Boolean);
  const channel = "BroadcastChannel" in window ? new BroadcastChannel("gpubroker-live") : null;
  let lastId = null;
  let leading = false;
  let live = false;
  let timer = null;

  function status(on) {
    live = on;
    if (badge) {
      badge.textContent = on ? "live" : "offline";
      badge.classList.toggle("on", on);
    }
  }

  async function load() {
    timer = null;
    const focused = document.activeElement;
    if (focused && main.contains(focused) && focused.closest("form")) {
      timer = setTimeout(load, 1000); // not while someone is choosing a filter
      return;
    }
    try {
      const answer = await fetch(main.dataset.fragment + location.search, { cache: "no-store" });
      if (answer.ok) main.innerHTML = await answer.text();
    } catch (_) {
      // the broker is restarting: the stream's reconnect brings the next message
    }
  }

  function refresh() {
    if (main && main.dataset.fragment && timer === null) timer = setTimeout(load, 250); // a burst is one fetch
  }

  function deliver(message) {
    if (message.id) lastId = message.id;
    refresh();
  }

  function stream() {
    const url = "/v1/stream" + (lastId ? "?after=" + encodeURIComponent(lastId) : "");
    const source = new EventSource(url); // on reconnect it sends Last-Event-ID itself
    const pass = (event) => {
      const message = { kind: "event", type: event.type, id: event.lastEventId || null, data: event.data };
      if (channel) channel.postMessage(message);
      deliver(message);
    };
    for (const type of types) source.addEventListener(type, pass);
    source.onopen = () => {
      status(true);
      if (channel) channel.postMessage({ kind: "status", live: true, id: lastId });
    };
    source.onerror = () => {
      status(false);
      if (channel) channel.postMessage({ kind: "status", live: false, id: lastId });
      if (source.readyState === EventSource.CLOSED) {
        setTimeout(stream, 10000); // refused (429) or gone for good: the browser will not retry by itself
      }
    };
  }

  function lead() {
    leading = true;
    refresh(); // messages may have passed between the old leader's going and this one's start
    stream();
    return new Promise(() => {}); // the lock is held until this tab closes
  }

  if (channel) {
    channel.onmessage = (event) => {
      const message = event.data || {};
      if (message.kind === "hello") {
        if (leading) channel.postMessage({ kind: "status", live, id: lastId });
      } else if (message.kind === "status") {
        if (!leading) {
          status(Boolean(message.live));
          if (message.id) lastId = message.id;
        }
      } else if (message.kind === "event" && !leading) {
        deliver(message);
      }
    };
  }

  if (channel && navigator.locks) {
    navigator.locks.request("gpubroker-stream", lead);
    channel.postMessage({ kind: "hello" });
  } else {
    lead(); // no way to share: this tab holds its own stream
  }
})();
