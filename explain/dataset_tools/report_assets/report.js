// The batch report's page logic: filters, sorting and paging over every image of the run.
//
// The page opens from the file system (file://), where fetch() of JSON is refused, so the data
// come as .js files loaded with <script> tags, each calling one of the functions of
// window.explainReport below:
//   keys-NNNN.js     per image, in blocks: true class, predicted class, first explained class,
//                    confidence (0..10000, -1 unknown), correct (1, 0, -1 unknown), file-name rank:
//                    everything filtering and sorting need, for every image, loaded at start;
//   chunk-NNNNN.js   per image, in chunks of meta.chunkSize: names, thumbnails, explained targets;
//                    loaded only for the images of the page shown;
//   strategies.js    the strategies of OUT/strategies.json, when present.
// Images are numbered by their position in the default order (misclassified first, then least
// confident), which is the order of the chunks.
// Every text taken from the data is put in the page with textContent, never parsed as HTML.

"use strict";

(function () {
  const meta = JSON.parse(document.getElementById("report-meta").textContent);
  const classNames = new Map(meta.classes.map(([index, name]) => [index, name]));
  const keyBlocks = [];
  const chunks = new Map(); // chunk number -> records
  const chunkLoads = new Map(); // chunk number -> Promise
  let strategies = null;
  let renderCount = 0;
  let renderToken = 0;

  window.explainReport = {
    addKeys(block, keys) { keyBlocks[block] = keys; },
    addChunk(number, records) { chunks.set(number, records); },
    addStrategies(data) { strategies = data; },
  };

  function loadScript(name) {
    return new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = meta.dataFolder + "/" + name;
      script.charset = "utf-8";
      script.onload = () => { script.remove(); resolve(); };
      script.onerror = () => { script.remove(); reject(new Error("could not load " + script.src)); };
      document.head.appendChild(script);
    });
  }

  function loadChunk(number) {
    if (chunks.has(number)) return Promise.resolve();
    if (!chunkLoads.has(number)) {
      const load = loadScript("chunk-" + String(number).padStart(5, "0") + ".js");
      load.catch(() => chunkLoads.delete(number)); // a failed load can be retried
      chunkLoads.set(number, load);
    }
    return chunkLoads.get(number);
  }

  // ---- Keys: flat arrays over every image --------------------------------------------------
  const keys = { label: [], predicted: [], explained: [], confidence: [], correct: [], nameRank: [] };

  function joinKeyBlocks() {
    for (const block of keyBlocks) {
      for (const field of Object.keys(keys)) {
        for (const value of block[field]) keys[field].push(value);
      }
    }
  }

  // ---- Helpers -----------------------------------------------------------------------------
  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function className(index, fallback) {
    if (index === null || index === undefined || index < 0) return fallback || "unknown";
    const name = classNames.get(index);
    return name ? name : "class " + index;
  }

  function formatNumber(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toFixed(digits);
  }

  function formatScore(value) {
    if (value === null || value === undefined) return "–";
    const magnitude = Math.abs(value);
    return magnitude !== 0 && (magnitude >= 1e4 || magnitude < 1e-3) ? value.toExponential(2) : value.toFixed(3);
  }

  function baseName(path) {
    const parts = String(path).split(/[\\/]/);
    return parts[parts.length - 1] || String(path);
  }

  function shortened(text, most) {
    // a long file name keeps its start and its end, the most telling parts
    return text.length <= most ? text : text.slice(0, Math.ceil(most * 0.4)) + "…" + text.slice(text.length
      - Math.floor(most * 0.6) + 1);
  }

  const byId = (id) => document.getElementById(id);

  // ---- Filters and sorting -----------------------------------------------------------------
  const controls = {
    label: byId("filter-label"),
    predicted: byId("filter-predicted"),
    explained: byId("filter-explained"),
    correctness: byId("filter-correctness"),
    minimum: byId("filter-confidence-min"),
    maximum: byId("filter-confidence-max"),
    sort: byId("sort"),
    pageSize: byId("page-size"),
  };
  const state = { page: 0, shown: [] };

  function fillClassSelect(select, field) {
    if (!select) return;
    const present = new Set(keys[field].filter((value) => value >= 0));
    const ordered = [...present].sort((a, b) => className(a).localeCompare(className(b)) || a - b);
    for (const index of ordered) {
      const option = element("option", null, className(index) + " (" + index + ")");
      option.value = String(index);
      select.appendChild(option);
    }
  }

  function number(input, fallback) {
    if (!input || input.value === "") return fallback;
    const value = Number(input.value);
    return Number.isFinite(value) ? value : fallback;
  }

  function matchingImages() {
    const wantLabel = controls.label ? Number(controls.label.value) : -2;
    const wantPredicted = controls.predicted ? Number(controls.predicted.value) : -2;
    const wantExplained = controls.explained ? Number(controls.explained.value) : -2;
    const correctness = controls.correctness ? controls.correctness.value : "all";
    const minimum = Math.round(number(controls.minimum, 0) * 10000);
    const maximum = Math.round(number(controls.maximum, 1) * 10000);
    const confidenceFiltered = minimum > 0 || maximum < 10000;
    const shown = [];
    for (let image = 0; image < meta.images; image++) {
      if (wantLabel !== -2 && keys.label[image] !== wantLabel) continue;
      if (wantPredicted !== -2 && keys.predicted[image] !== wantPredicted) continue;
      if (wantExplained !== -2 && keys.explained[image] !== wantExplained) continue;
      const correct = keys.correct[image];
      if (correctness === "wrong" && correct !== 0) continue;
      if (correctness === "correct" && correct !== 1) continue;
      if (correctness === "unlabelled" && correct !== -1) continue;
      if (correctness === "low" && !(keys.confidence[image] >= 0 &&
                                     keys.confidence[image] < meta.lowConfidence * 10000)) continue;
      if (confidenceFiltered) {
        const confidence = keys.confidence[image];
        if (confidence < 0 || confidence < minimum || confidence > maximum) continue;
      }
      shown.push(image);
    }
    const sort = controls.sort.value;
    const byClass = (field) => (a, b) => {
      const left = keys[field][a], right = keys[field][b];
      if ((left < 0) !== (right < 0)) return left < 0 ? 1 : -1;
      return className(left).localeCompare(className(right)) || left - right || a - b;
    };
    const byConfidence = (direction) => (a, b) => {
      const left = keys.confidence[a], right = keys.confidence[b];
      if ((left < 0) !== (right < 0)) return left < 0 ? 1 : -1; // unknown confidence last
      return direction * (left - right) || a - b;
    };
    if (sort === "confidence-ascending") shown.sort(byConfidence(1));
    else if (sort === "confidence-descending") shown.sort(byConfidence(-1));
    else if (sort === "label") shown.sort(byClass("label"));
    else if (sort === "predicted") shown.sort(byClass(meta.hasPredictions ? "predicted" : "explained"));
    else if (sort === "name") shown.sort((a, b) => keys.nameRank[a] - keys.nameRank[b]);
    return shown; // "default": the positions are the default order already
  }

  function pageSize() {
    return Math.max(1, Number(controls.pageSize.value) || meta.pageSize);
  }

  // ---- Rendering the gallery ---------------------------------------------------------------
  const gallery = byId("gallery");
  const statusText = byId("gallery-count");

  function record(image) {
    return chunks.get(Math.floor(image / meta.chunkSize))[image % meta.chunkSize];
  }

  function badgesOf(item, target) {
    const badges = element("div", "badges");
    if (target.class !== null && item.label !== null && target.class === item.label) {
      badges.appendChild(element("span", "badge true", "true class"));
    }
    if (target.class !== null && item.predicted !== null && target.class === item.predicted) {
      badges.appendChild(element("span", "badge predicted" + (item.correct === false ? " wrong" : ""), "predicted"));
    }
    if (target.role && target.role !== "label" && target.role !== "predicted") {
      badges.appendChild(element("span", "badge", target.role === "topk" ? "top-k" : target.role));
    }
    return badges;
  }

  function panel(item, target, altPrefix) {
    const figure = element("figure");
    if (target.thumb) {
      const image = element("img");
      image.src = target.thumb;
      image.alt = altPrefix + ": " + targetName(target);
      image.decoding = "async";
      figure.appendChild(image);
    } else {
      figure.appendChild(element("div", "no-image", "no map"));
    }
    const caption = element("figcaption");
    const name = element("span", "class-name", targetName(target));
    name.title = name.textContent;
    caption.appendChild(name);
    let numbers = "score " + formatScore(target.score);
    if (target.probability !== null) numbers += " · p " + formatNumber(target.probability, 3);
    if (meta.method) numbers += " · " + meta.method;
    caption.appendChild(element("span", "numbers", numbers));
    caption.appendChild(badgesOf(item, target));
    figure.appendChild(caption);
    return figure;
  }

  function targetName(target) {
    return target.class === null ? (target.name || "no class") : className(target.class, target.name);
  }

  function verdict(item) {
    if (item.label !== null && item.predicted !== null) {
      const wrong = item.correct === false;
      return element("div", "verdict " + (wrong ? "wrong" : "correct"),
        wrong ? "✗ " + className(item.label) + " → predicted " + className(item.predicted)
              : "✓ " + className(item.label));
    }
    if (item.predicted !== null) return element("div", "verdict", "predicted " + className(item.predicted));
    if (item.label !== null) return element("div", "verdict", "true class " + className(item.label));
    return element("div", "verdict"); // an index without labels and predictions
  }

  function card(image) {
    const item = record(image);
    const low = item.confidence !== null && item.confidence < meta.lowConfidence;
    const node = element("article", "card" + (item.correct === false ? " wrong" : item.correct ? " correct" : "")
                         + (low ? " low" : ""));
    node.tabIndex = 0;
    node.dataset.id = item.id;
    node.dataset.position = String(image);
    node.dataset.label = item.label === null ? "" : String(item.label);
    node.dataset.predicted = item.predicted === null ? "" : String(item.predicted);
    node.dataset.confidence = item.confidence === null ? "" : String(item.confidence);
    node.dataset.correct = item.correct === null ? "" : item.correct ? "1" : "0";
    const panels = element("div", "panels");
    for (const target of item.targets) panels.appendChild(panel(item, target, baseName(item.image)));
    node.appendChild(panels);
    const details = element("div", "details");
    const name = element("div", "file-name", shortened(baseName(item.image), 26 * Math.min(item.targets.length, 4)));
    name.title = item.image;
    details.appendChild(name);
    details.appendChild(verdict(item));
    if (item.confidence !== null) {
      const confidence = element("div", "confidence");
      const bar = element("span", "bar");
      const fill = element("span");
      fill.style.width = (100 * item.confidence).toFixed(1) + "%";
      bar.appendChild(fill);
      confidence.appendChild(bar);
      confidence.appendChild(element("span", null, "confidence " + formatNumber(item.confidence, 3)
                                     + (low ? " (low)" : "")));
      details.appendChild(confidence);
    }
    node.appendChild(details);
    node.addEventListener("click", () => showDetail(item));
    node.addEventListener("keydown", (event) => { if (event.key === "Enter") showDetail(item); });
    return node;
  }

  async function render() {
    const token = ++renderToken;
    gallery.dataset.state = "loading";
    const size = pageSize();
    const pages = Math.max(1, Math.ceil(state.shown.length / size));
    state.page = Math.min(Math.max(0, state.page), pages - 1);
    const start = state.page * size;
    const onPage = state.shown.slice(start, start + size);
    try {
      await Promise.all([...new Set(onPage.map((image) => Math.floor(image / meta.chunkSize)))].map(loadChunk));
    } catch (error) {
      if (token !== renderToken) return;
      gallery.replaceChildren(element("div", "empty", "The report's data could not be loaded (" + error.message
        + "): regenerate the report with `explain report`."));
      gallery.dataset.state = "error";
      return;
    }
    if (token !== renderToken) return; // a newer render started while the chunks loaded
    const cards = onPage.map(card);
    // cards as wide as their panels: each column fits the most panels a card of this page has (up to 4)
    const panels = Math.min(4, Math.max(1, ...onPage.map((image) => record(image).targets.length)));
    gallery.style.gridTemplateColumns = "repeat(auto-fill, minmax(" + (panels * 175) + "px, 1fr))";
    if (!cards.length) {
      cards.push(element("div", "empty", meta.images ? "No image matches these filters."
        : "The run has no images yet: write the report again once explain batch has explained some."));
    }
    gallery.replaceChildren(...cards);
    statusText.textContent = state.shown.length
      ? "Showing " + (start + 1).toLocaleString("en") + "–" + (start + onPage.length).toLocaleString("en") + " of "
        + state.shown.length.toLocaleString("en") + " images" + (state.shown.length < meta.images
        ? " (" + meta.images.toLocaleString("en") + " in the run)" : "")
      : "0 of " + meta.images.toLocaleString("en") + " images";
    for (const pager of document.querySelectorAll(".gallery-pager")) {
      pager.querySelector(".page-number").textContent = "Page " + (state.page + 1) + " of " + pages;
      pager.querySelector(".first").disabled = pager.querySelector(".previous").disabled = state.page === 0;
      pager.querySelector(".next").disabled = pager.querySelector(".last").disabled = state.page >= pages - 1;
    }
    gallery.dataset.page = String(state.page + 1);
    gallery.dataset.pages = String(pages);
    gallery.dataset.matching = String(state.shown.length);
    gallery.dataset.render = String(++renderCount);
    gallery.dataset.state = "ready";
  }

  function refilter() {
    state.shown = matchingImages();
    state.page = 0;
    render();
  }

  function goToPage(page, scroll) {
    state.page = page;
    render().then(() => { if (scroll) byId("gallery-section").scrollIntoView(); });
  }

  for (const pager of document.querySelectorAll(".gallery-pager")) {
    const scroll = pager.classList.contains("bottom");
    pager.querySelector(".first").addEventListener("click", () => goToPage(0, scroll));
    pager.querySelector(".previous").addEventListener("click", () => goToPage(state.page - 1, scroll));
    pager.querySelector(".next").addEventListener("click", () => goToPage(state.page + 1, scroll));
    pager.querySelector(".last").addEventListener("click", () => goToPage(Number.MAX_SAFE_INTEGER, scroll));
  }

  function resetFilters() {
    for (const select of [controls.label, controls.predicted, controls.explained]) if (select) select.value = "-2";
    if (controls.correctness) controls.correctness.value = "all";
    if (controls.minimum) controls.minimum.value = "";
    if (controls.maximum) controls.maximum.value = "";
  }

  // Summary tables and the confusion matrix filter the gallery: elements with data-label and/or
  // data-predicted (class indices) set those filters and scroll to the gallery.
  function bindSummaryLinks() {
    for (const link of document.querySelectorAll("[data-filter]")) {
      link.addEventListener("click", (event) => {
        event.stopPropagation(); // a button inside a row that filters too
        resetFilters();
        const label = link.dataset.label, predicted = link.dataset.predicted, explained = link.dataset.explained;
        if (label !== undefined && controls.label) controls.label.value = label;
        if (predicted !== undefined && controls.predicted) controls.predicted.value = predicted;
        if (explained !== undefined && controls.explained) controls.explained.value = explained;
        if (link.dataset.correctness && controls.correctness) controls.correctness.value = link.dataset.correctness;
        refilter();
        byId("gallery-section").scrollIntoView();
      });
    }
  }

  // ---- The detail dialog -------------------------------------------------------------------
  const dialog = byId("detail");

  function showDetail(item) {
    const content = dialog.querySelector(".content");
    content.replaceChildren();
    content.appendChild(element("h3", null, item.image));
    if (item.overlay) {
      const full = element("div", "full");
      const image = element("img");
      image.src = item.overlay;
      image.alt = "overlays of " + baseName(item.image);
      image.style.width = Math.min(1000, 320 * item.targets.length) + "px"; // small images drawn larger
      full.appendChild(image);
      content.appendChild(full);
    } else {
      const full = element("div", "full panels");
      for (const target of item.targets) {
        if (!target.thumb) continue;
        const image = element("img");
        image.src = target.thumb;
        image.alt = targetName(target);
        full.appendChild(image);
      }
      content.appendChild(full);
    }
    content.appendChild(verdict(item));
    const table = element("table", "data");
    const head = element("tr");
    for (const title of ["k", "explained class", "score", "probability", "why explained", "is"]) {
      head.appendChild(element("th", null, title));
    }
    table.appendChild(element("thead")).appendChild(head);
    const body = element("tbody");
    item.targets.forEach((target, k) => {
      const row = element("tr");
      row.appendChild(element("td", "n", k));
      row.appendChild(element("td", "class-name", targetName(target)));
      row.appendChild(element("td", "n", formatScore(target.score)));
      row.appendChild(element("td", "n", formatNumber(target.probability, 4)));
      row.appendChild(element("td", null, target.role || "–"));
      const cell = element("td");
      cell.appendChild(badgesOf(item, target));
      row.appendChild(cell);
      body.appendChild(row);
    });
    table.appendChild(body);
    content.appendChild(table);
    const facts = element("div", "links");
    facts.appendChild(element("span", null, "id " + item.id + (item.confidence !== null
      ? " · confidence " + formatNumber(item.confidence, 4) : "") + (meta.method ? " · " + meta.method : "")));
    content.appendChild(facts);
    const links = element("div", "links");
    if (item.overlay) {
      const link = element("a", null, "overlay PNG");
      link.href = item.overlay;
      links.appendChild(link);
    }
    if (item.source) {
      const link = element("a", null, "source image");
      link.href = item.source;
      links.appendChild(link);
    }
    content.appendChild(links);
    dialog.showModal();
  }

  dialog.querySelector(".close").addEventListener("click", () => dialog.close());
  dialog.addEventListener("click", (event) => { if (event.target === dialog) dialog.close(); });

  // ---- Strategies --------------------------------------------------------------------------
  const strategyState = { page: 0, perPage: 8, flaggedOnly: false };

  function renderStrategies() {
    const section = byId("strategies-list");
    if (!section || !strategies) return;
    const classes = strategies.classes.filter((entry) => !strategyState.flaggedOnly || entry.flagged > 0);
    const pages = Math.max(1, Math.ceil(classes.length / strategyState.perPage));
    strategyState.page = Math.min(Math.max(0, strategyState.page), pages - 1);
    const start = strategyState.page * strategyState.perPage;
    const nodes = classes.slice(start, start + strategyState.perPage).map(strategyClass);
    if (!nodes.length) {
      nodes.push(element("p", "hint", strategies.classes.length ? "No class has a flagged cluster."
        : "No class was analysed: none had enough maps."));
    }
    section.replaceChildren(...nodes);
    const pager = byId("strategies-pager");
    pager.querySelector(".page-number").textContent = "Page " + (strategyState.page + 1) + " of " + pages;
    pager.querySelector(".previous").disabled = strategyState.page === 0;
    pager.querySelector(".next").disabled = strategyState.page >= pages - 1;
    section.dataset.render = String(Number(section.dataset.render || 0) + 1);
  }

  function strategyClass(entry) {
    const box = element("div", "strategy-class");
    box.dataset.class = String(entry.class);
    const title = element("h3", null);
    const name = element("span", "class-name", entry.name || "class " + entry.class);
    title.appendChild(name);
    title.appendChild(element("span", "class-index", "(" + entry.class + ")"));
    title.appendChild(element("span", "summary", entry.images + " images · " + entry.clusters.length + " cluster"
      + (entry.clusters.length === 1 ? "" : "s") + " (eigengap: " + entry.eigengapClusters + ")"
      + (entry.flagged ? " · " + entry.flagged + " flagged" : "")));
    box.appendChild(title);
    const clusters = element("div", "clusters");
    for (const cluster of entry.clusters) clusters.appendChild(strategyCluster(entry, cluster));
    box.appendChild(clusters);
    return box;
  }

  function strategyCluster(entry, cluster) {
    const box = element("div", "cluster" + (cluster.flagged ? " flagged" : ""));
    box.dataset.cluster = String(cluster.cluster);
    box.dataset.flagged = cluster.flagged ? "1" : "0";
    const mean = element("div", "mean-map");
    if (cluster.meanMap) {
      const image = element("img");
      image.src = cluster.meanMap;
      image.alt = "mean map of cluster " + cluster.cluster;
      mean.appendChild(image);
    }
    mean.appendChild(element("div", "caption", "mean map"));
    box.appendChild(mean);
    const about = element("div", "about");
    const share = entry.images ? " (" + Math.round(100 * cluster.size / entry.images) + " %)" : "";
    about.appendChild(element("div", "title", "Cluster " + cluster.cluster + " · " + cluster.size + " images" + share));
    if (cluster.peak) {
      about.appendChild(element("div", null, "peak at y " + formatNumber(cluster.peak[0], 2) + ", x "
        + formatNumber(cluster.peak[1], 2)));
    }
    if (cluster.flagged) about.appendChild(element("div", "reason", "⚑ flagged: " + (cluster.reason || "no reason given")));
    const examples = element("div", "examples");
    for (const example of cluster.examples) {
      if (example.thumb) {
        const image = element("img");
        image.src = example.thumb;
        image.alt = example.image || example.id;
        image.title = example.image || example.id;
        examples.appendChild(image);
      } else {
        examples.appendChild(element("span", "missing", example.id));
      }
    }
    about.appendChild(examples);
    box.appendChild(about);
    return box;
  }

  function bindStrategies() {
    const pager = byId("strategies-pager");
    if (!pager) return;
    pager.querySelector(".previous").addEventListener("click", () => { strategyState.page--; renderStrategies(); });
    pager.querySelector(".next").addEventListener("click", () => { strategyState.page++; renderStrategies(); });
    byId("strategies-flagged").addEventListener("change", (event) => {
      strategyState.flaggedOnly = event.target.checked;
      strategyState.page = 0;
      renderStrategies();
    });
  }

  // ---- Start -------------------------------------------------------------------------------
  async function start() {
    const loads = [];
    for (let block = 0; block < meta.keyFiles; block++) {
      loads.push(loadScript("keys-" + String(block).padStart(4, "0") + ".js"));
    }
    if (meta.strategies) loads.push(loadScript("strategies.js"));
    try {
      await Promise.all(loads);
    } catch (error) {
      gallery.replaceChildren(element("div", "empty", "The report's data could not be loaded (" + error.message
        + "): regenerate the report with `explain report`."));
      gallery.dataset.state = "error";
      return;
    }
    joinKeyBlocks();
    fillClassSelect(controls.label, "label");
    fillClassSelect(controls.predicted, "predicted");
    fillClassSelect(controls.explained, "explained");
    controls.pageSize.value = String(meta.pageSize);
    for (const control of [controls.label, controls.predicted, controls.explained, controls.correctness,
                           controls.sort, controls.pageSize]) {
      if (control) control.addEventListener("change", refilter);
    }
    for (const control of [controls.minimum, controls.maximum]) {
      if (control) control.addEventListener("input", refilter);
    }
    byId("reset-filters").addEventListener("click", () => {
      resetFilters();
      controls.sort.value = "default";
      refilter();
    });
    bindSummaryLinks();
    bindStrategies();
    renderStrategies();
    refilter();
  }

  start();
})();
